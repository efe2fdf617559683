import itertools
import math

import pytest
from conftest import install_distribution

from fa4tune.errors import SpaceError
from fa4tune.kernels import get_kernel
from fa4tune.problem import Problem
from fa4tune.space import (
    Choice,
    Range,
    SearchSpace,
    available_spaces,
    compose,
    domain_of,
    get_space,
    parse_domain,
)
from fa4tune.target import get_target

KERNEL = get_kernel("fa4_fwd_sm90")
H200 = get_target("H200")


def test_domain_of_keeps_bools_apart_and_orders_numeric_runs():
    assert domain_of((True, False)) == Choice((True, False))
    stages = domain_of((1, 2, 3, 4, 5))
    assert isinstance(stages, Range) and stages.integer and stages.values() == [1, 2, 3, 4, 5]
    share = domain_of((0.0, 0.125, 0.25, 0.375, 0.5))
    assert share.values() == [0.0, 0.125, 0.25, 0.375, 0.5]
    assert domain_of((0.0, 2.0, 4.0, 8.0)) == Choice((0.0, 2.0, 4.0, 8.0))
    assert not Choice((True, False)).contains(1)
    assert not Choice((1, 2)).contains(True)
    assert not stages.contains(2.5) and stages.contains(3)


def test_parse_domain_forms():
    assert parse_domain([64, 128], "tile_n") == Choice((64, 128))
    r = parse_domain({"low": 64, "high": 128, "step": 16}, "tile_n")
    assert r.values() == [64, 80, 96, 112, 128]
    assert parse_domain(3, "poly_degree") == Choice((3,))
    with pytest.raises(SpaceError, match="tile_n"):
        parse_domain({"low": 64}, "tile_n")
    with pytest.raises(SpaceError, match="tile_n: an empty list"):
        parse_domain([], "tile_n")


def test_builtins_cover_the_kernel_knobs_without_overlap():
    builtins = ("tiles", "pipeline", "exp2", "softmax", "decode")
    space = compose(KERNEL, {name: {} for name in builtins})
    assert sorted(space.param_names) == sorted(KERNEL.knobs)
    assert set(builtins) <= set(available_spaces())
    # The decode knobs are searched only where a job names the decode space.
    assert "decode" not in KERNEL.default_spaces
    assert not {"pack_gqa", "num_splits"} & set(compose(KERNEL).param_names)


def test_a_parameter_declared_by_two_plugins_is_an_error():
    class TileN(get_space("tiles")):
        name = "tile_n_again"
        knobs = ("tile_n",)

    with pytest.raises(
        SpaceError, match="'tile_n' is declared by both space 'tiles' and space 'tile_n_again'"
    ):
        from fa4tune.space import ComposedSpace

        ComposedSpace(KERNEL, [get_space("tiles")(KERNEL), TileN(KERNEL)])


def test_unknown_space_and_parameter_list_the_known_ones():
    with pytest.raises(SpaceError, match="unknown search space 'tilez'; known spaces: .*tiles"):
        get_space("tilez")
    with pytest.raises(
        SpaceError, match="has no parameter 'tile_k'; its parameters: tile_m, tile_n"
    ):
        compose(KERNEL, {"tiles": {"tile_k": Choice([1])}})
    with pytest.raises(SpaceError, match="tile_n value.*100.*outside its domain"):
        compose(KERNEL, {"tiles": {"tile_n": Choice([96, 100])}})


def test_the_default_is_always_in_the_searched_domain():
    problem = Problem(head_dim=64, seqlen_q=4096)
    default = KERNEL.default_config(problem, H200).to_dict()
    space = compose(KERNEL, {"tiles": {"tile_n": Choice([64])}})
    domains = space.domains(problem, H200)
    assert domains["tile_n"].contains(default["tile_n"]) and domains["tile_n"].contains(64)


def test_a_continuous_range_over_a_knob_with_few_values_means_those_values_in_it():
    """Only the ends used to be checked: {low: 0, high: 8} over the thresholds 0, 2, 4, 8 passed,
    and every value between the legal ones was then proposed and rejected."""
    problem = Problem(head_dim=128, seqlen_q=4096)
    space = compose(KERNEL, {"softmax": {"rescale_threshold": Range(0.0, 8.0)}})
    assert space.domains(problem, H200)["rescale_threshold"] == Choice((0.0, 2.0, 4.0, 8.0))
    # A range that leaves out the default keeps its values and gains the default (it used to shrink
    # to the default alone).
    space = compose(KERNEL, {"exp2": {"emu_share": Range(0.125, 0.5)}})
    default = KERNEL.default_config(problem, H200).emu_share
    assert set(space.domains(problem, H200)["emu_share"].values()) == {
        default,
        0.125,
        0.25,
        0.375,
        0.5,
    }
    with pytest.raises(SpaceError, match="range float 2.5..3.5 holds none of its values"):
        compose(KERNEL, {"softmax": {"rescale_threshold": Range(2.5, 3.5)}})
    # As a job writes it: YAML's {low: 0, high: 8} is an integer range.
    from fa4tune.space import parse_domain

    space = compose(
        KERNEL,
        {
            "softmax": {"rescale_threshold": parse_domain({"low": 0, "high": 8}, "x")},
            "tiles": {"tile_n": parse_domain({"low": 64, "high": 128}, "tile_n")},
        },
    )
    domains = space.domains(problem, H200)
    assert domains["rescale_threshold"] == Choice((0.0, 2.0, 4.0, 8.0))
    # A range whose every value is legal stays the ordered range it was (and so does the study
    # name).
    stages = compose(
        KERNEL, {"pipeline": {"num_stages": parse_domain({"low": 2, "high": 4}, "num_stages")}}
    )
    assert stages.spaces[0].domains["num_stages"] == Range(2, 4, integer=True)
    assert set(domains["tile_n"].values()) >= {64, 128} and 65 not in domains["tile_n"].values()


def test_checks_union_plugins_and_kernel_with_reasons():
    space = compose(KERNEL)
    problem = Problem(head_dim=256, seqlen_q=4096)
    huge = space.full_config(
        problem,
        H200,
        {"tile_m": 192, "tile_n": 192, "num_stages": 5, "poly_degree": 1, "emu_share": 0.5},
    )
    reasons = space.check(problem, huge, H200)
    assert any("shared memory" in r for r in reasons)
    assert any("exp2" in r or "degree" in r for r in reasons)
    assert len(reasons) == len(set(reasons))
    assert space.check(problem, space.full_config(problem, H200, {}), H200) == []
    # A value outside the kernel's schema is no config at all.
    with pytest.raises(KERNEL.config_error, match="tile_n=100"):
        KERNEL.config({**huge.to_dict(), "tile_n": 100})


def test_every_feasible_config_passes_the_kernel_and_every_plugin_reason_is_the_kernels_too():
    """The plugins may not be stricter or looser than the kernel's own rules on the knobs they
    own."""
    space = compose(
        KERNEL,
        {
            "exp2": {"poly_degree": Choice([1, 3]), "emu_share": Choice([0.0, 0.25])},
            "softmax": {"rescale_threshold": Choice([0.0])},
        },
    )
    problem = Problem(head_dim=128, seqlen_q=2048)
    grid = space.grid(problem, H200)
    for values in itertools.product(*grid.values()):
        config = space.full_config(problem, H200, dict(zip(grid, values)))
        assert bool(space.check(problem, config, H200)) == bool(
            KERNEL.infeasible_reasons(problem, config, H200)
        )


def test_every_legal_threshold_keeps_p_within_fp16():
    """Unnormalised P reaches 2^rescale_threshold, which the P operand of the PV GEMM must hold: no
    legal threshold comes near fp16's largest value (2^15.99), which is why no rule checks it. A
    wider knob domain would need that rule back."""
    from fa4tune.kernels.fa4_fwd_sm90.config import KNOBS

    assert max(KNOBS["rescale_threshold"]) + 1 < math.log2(65504.0)


def test_spaces_leave_the_rules_to_the_kernel_family():
    """The built-in plugins add no rules: the family's rules are the one place (a space that checked
    them too ran each rule again per candidate)."""
    for name in KERNEL.default_spaces:
        assert type(get_space(name)(KERNEL)).check is SearchSpace.check, name


def test_lazy_max_needs_a_threshold_above_a_row_of_equal_scores():
    """The fast path holds while a thread's row sum stays within 2^rescale_threshold; a row of equal
    scores sums to tile_n / 4 there, so the kernel refuses thresholds below twice that."""
    problem = Problem(head_dim=128, seqlen_q=2048)
    ok = KERNEL.config({"rescale_threshold": 8.0, "lazy_max": True, "tile_n": 192})
    assert KERNEL.infeasible_reasons(problem, ok, H200) == []
    low = KERNEL.config({"rescale_threshold": 4.0, "lazy_max": True, "tile_n": 64})
    reasons = KERNEL.infeasible_reasons(problem, low, H200)
    assert reasons and "rescale_threshold >= 5.00" in reasons[0]
    assert compose(KERNEL).check(problem, low, H200) == reasons
    assert (
        KERNEL.infeasible_reasons(
            problem, KERNEL.config({"rescale_threshold": 4.0, "tile_n": 64}), H200
        )
        == []
    )
    # The emulated exp2 is wrong past 2^127, and the lazy step exponentiates whole rises: MUFU only.
    emulated = KERNEL.config({"rescale_threshold": 8.0, "lazy_max": True, "emu_share": 0.25})
    reasons = KERNEL.infeasible_reasons(problem, emulated, H200)
    assert reasons and "emu_share 0.25" in reasons[0]


@pytest.mark.parametrize(
    "head_dim,head_dim_v", [(64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)]
)
def test_the_default_takes_the_lazy_max_at_every_head_dim(head_dim, head_dim_v):
    """Run 11 searched (and shipped) with the lazy max in every default: a default that loses it, or
    one the softmax plugin refuses, would start every search from a config it never measured."""
    problem = Problem(head_dim=head_dim, head_dim_v=head_dim_v, seqlen_q=4096, causal=True)
    default = KERNEL.default_config(problem, H200)
    assert default.lazy_max and default.rescale_threshold == 8.0 and default.emu_share == 0.0
    assert get_space("softmax")(KERNEL).check(problem, default, H200) == []
    assert KERNEL.infeasible_reasons(problem, default, H200) == []


def test_entry_point_plugin_is_discovered(entry_point_plugin):
    spaces = available_spaces()
    assert "even_stages" in spaces
    plugin = spaces["even_stages"](KERNEL)
    assert plugin.domains["num_stages"].values() == [2, 4]


def test_probes_change_one_knob_each_nearest_first_and_stay_feasible():
    space = compose(KERNEL)
    target = get_target("H200")
    problem = Problem(head_dim=64, seqlen_q=1024, batch=16, nheads_q=32, causal=True)
    default = space.default_params(problem, target)
    probes = space.probes(problem, target, 16)
    assert len(probes) == 16
    changed = [
        [k for k in default if not (probe[k] == default[k] and type(probe[k]) is type(default[k]))]
        for probe in probes
    ]
    # one knob each, or up to three where one of them alone is infeasible beside the default's
    # others
    assert all(
        len(c) == 1
        or (
            len(c) <= 3
            and any(
                space.check(
                    problem, space.full_config(problem, target, {**default, k: p[k]}), target
                )
                for k in c
            )
        )
        for c, p in zip(changed, probes)
    ), changed
    keys = [space.full_config(problem, target, p) for p in probes]
    assert len(set(keys)) == len(keys), "two probes are the same kernel"
    assert space.full_config(problem, target, default) not in keys
    assert all(
        space.check(problem, space.full_config(problem, target, p), target) == [] for p in probes
    )
    # poly_degree alone is no kernel change while emu_share is 0: never probed by itself
    assert ["poly_degree"] not in changed
    # the first round takes each knob's nearest values (both, the larger first, when two are equally
    # near) before any knob's next ones: tile_m 192 at hdim 64 probes 256 (repaired) and 128 first
    probed = [
        next(
            k
            for k in c
            if space.check(
                problem, space.full_config(problem, target, {**default, k: p[k]}), target
            )
            or len(c) == 1
        )
        for c, p in zip(changed, probes)
    ]
    assert probed[:2] == ["tile_m", "tile_m"] and [p["tile_m"] for p in probes[:2]] == [256, 128]
    first_round = probed[: probed.index("tile_m", 2)] if "tile_m" in probed[2:] else probed
    assert len(set(first_round)) >= 6
    # numbers: the nearest other value first, the larger on a tie
    stages = [p["num_stages"] for p, c in zip(probes, changed) if c == ["num_stages"]]
    assert stages[:2] == [default["num_stages"] + 1, default["num_stages"] - 1]
    assert space.probes(problem, target, 0) == [] and space.probes(problem, target, 3) == probes[:3]


def test_a_value_infeasible_beside_the_default_is_probed_with_the_nearest_repair():
    """Four consumer warpgroups (tile_m 256) cannot hold hdim 64's default 128-wide K/V blocks with
    intra-warpgroup overlap. The nearest repair is two knobs away from the default (the overlap off,
    the nearest feasible block width 96: places 1 + 4) and beats the one-knob repair (64-wide blocks
    with the overlap: place 8), so that is what is probed instead of never probing tile_m 256."""
    space = compose(KERNEL)
    target = get_target("H200")
    problem = Problem(head_dim=64, seqlen_q=1024, batch=16, nheads_q=32)
    default = space.default_params(problem, target)
    assert default["tile_m"] == 192 and default["tile_n"] == 128 and default["intra_wg_overlap"]
    assert space.check(
        problem, space.full_config(problem, target, {**default, "tile_m": 256}), target
    )
    probe = space.probes(problem, target, 1)[0]
    assert {k: v for k, v in probe.items() if v != default[k]} == {
        "tile_m": 256,
        "tile_n": 96,
        "intra_wg_overlap": False,
    }
    assert space.check(
        problem,
        space.full_config(problem, target, {**default, "tile_m": 256, "tile_n": 96}),
        target,
    )
    assert space.check(problem, space.full_config(problem, target, probe), target) == []


def test_a_plugins_mistakes_are_named_before_any_search():
    from fa4tune.space import SearchSpace

    class NotParams(SearchSpace):
        name, knobs = "not_params", ("num_stages",)

        def params(self):
            return {"num_stages": [2, 4]}

    class OtherKnob(SearchSpace):
        name, knobs = "other_knob", ("num_stages",)

        def params(self):
            return {"tile_n": Choice([64])}

    class SevenStages(SearchSpace):
        name, knobs = "seven", ("num_stages",)

        def params(self):
            return {"num_stages": Choice([2, 7])}

    for cls, message in (
        (NotParams, "domain of num_stages must be a Choice or a Range"),
        (OtherKnob, r"a domain to each of its knobs \(num_stages\); it gave tile_n"),
        (SevenStages, r"num_stages value\(s\) 7 are not values the kernel takes"),
    ):
        with pytest.raises(SpaceError, match=f"space '{cls.name}' .*{message}"):
            cls(KERNEL)


def test_a_plugin_check_that_raises_is_named_and_a_plugin_default_is_the_starting_config():
    from fa4tune.space import ComposedSpace, SearchSpace

    class Broken(SearchSpace):
        name, knobs = "broken", ("num_stages",)

        def check(self, problem, config, target):
            return 1 / 0

    class StartAtThree(SearchSpace):
        name, knobs = "start_at_three", ("num_stages",)

        def default(self, problem, target):
            return {"num_stages": 3}

    problem = Problem(head_dim=64, seqlen_q=4096)
    broken = ComposedSpace(KERNEL, [get_space("tiles")(KERNEL), Broken(KERNEL)])
    with pytest.raises(SpaceError, match=r"space 'broken': check\(\) raised ZeroDivisionError"):
        broken.check(problem, broken.full_config(problem, H200, {}), H200)
    three = ComposedSpace(KERNEL, [get_space("tiles")(KERNEL), StartAtThree(KERNEL)])
    assert three.full_config(problem, H200, {}).num_stages == 3
    assert three.domains(problem, H200)["num_stages"].contains(3)


def test_a_broken_entry_point_stops_only_the_jobs_that_need_it(
    entry_point_plugin, tmp_path, monkeypatch
):
    import fa4tune.space

    install_distribution(
        tmp_path / "site2",
        "fa4tune-broken",
        "[fa4tune.spaces]\nbroken = no_such_module_anywhere:Space\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site2"))
    fa4tune.space.rediscover()
    try:
        assert get_space("tiles").name == "tiles"  # a built-in: the entry points are not loaded
        assert (
            get_space("even_stages").name == "even_stages"
        )  # another plugin: only its own is loaded
        with pytest.raises(SpaceError, match="cannot load search space entry point 'broken'"):
            get_space("broken")
    finally:
        fa4tune.space.rediscover()
