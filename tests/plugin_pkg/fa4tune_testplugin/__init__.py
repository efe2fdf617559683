"""A third-party search space, registered only through the `fa4tune.spaces` entry point (the tests
write a dist-info for it): searches num_stages over even values and rejects one combination."""

from fa4tune.space import Choice, SearchSpace

REJECTED = "even_stages test rule: num_stages=4 with tile_n >= 160 is refused"


class EvenStagesSpace(SearchSpace):
    name = "even_stages"
    knobs = ("num_stages",)

    def params(self):
        return {"num_stages": Choice([2, 4])}

    def check(self, problem, config, target):
        if config.num_stages == 4 and config.tile_n >= 160:
            return [REJECTED]
        return []
