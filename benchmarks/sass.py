"""What ptxas made of a config, read without a GPU: the config is compiled for sm_90a
(`CUTE_DSL_ARCH`, the cache bypassed), its cubin disassembled with nvdisasm, and the SASS counted.

    python benchmarks/sass.py [--shape 128:16384:causal | --problem head_dim=128,seqlen_q=1,...]
                              [--backward] [--set knob=value ...] [--dump DIR] [--nvdisasm PATH]

The problem is a grid shape ('head_dim:seqlen[:causal][:gN]', as benchmarks/ncu_profile.py takes
it) or --problem's fields (a job file's problem fields, comma-separated: decode shapes). Its default
config is compiled, and with --set the default with those knobs changed (the backward's main kernel
with --backward: fa4_bwd_sm90's knobs). Per config the table gives the registers a thread
launches with (from cuobjdump, when it is found; setmaxnreg then moves them per warpgroup), the
instructions, and the counts that the profiles of this project
kept asking about: HGMMAs; MUFU.EX2 and the longest run of them back to back (ptxas's schedule of
the exp block: a run of 32 is a warp's whole exp block queued on the MUFU with nothing between);
FFMAs; shared loads and stores by width; named-barrier syncs and arrives; local memory (spills).
--dump keeps each config's SASS as DIR/<config>.sass for reading.

nvdisasm comes with the CUDA toolkit, or as the pip wheel nvidia-cuda-nvdisasm (cuobjdump as
nvidia-cuda-cuobjdump); a disassembler missing is said, and the script stops. The counts are of the
static code (each instruction once, whatever its trip count): a loop's body counts once."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def find_tool(name: str, given: str | None = None) -> str | None:
    """`given`, else `name` on PATH, else the one in the nvidia-cuda-<name> wheel."""
    if given:
        return given if Path(given).exists() else None
    found = shutil.which(name)
    if found:
        return found
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        for candidate in sorted(Path(root).glob(f"*/bin/{name}")):
            return str(candidate)
    return None


def opcodes(sass: str) -> list[str]:
    """The opcode (with its modifiers) of each instruction, in order."""
    return [m.group(1) for m in INSTRUCTION.finditer(sass)]


def longest_run(ops: list[str], prefix: str) -> int:
    best = run = 0
    for op in ops:
        run = run + 1 if op.startswith(prefix) else 0
        best = max(best, run)
    return best


def summarize(ops: list[str]) -> dict:
    """The counts of the table (each instruction of the static code once)."""
    counts = Counter(ops)

    def count(*prefixes: str) -> int:
        return sum(n for op, n in counts.items() if op.startswith(prefixes))

    def by_width(kind: str) -> str:
        widths = Counter()
        for op, n in counts.items():
            if op == kind or op.startswith(kind + "."):
                width = next((w for w in ("128", "64", "U16", "U8") if f".{w}" in op), "32")
                widths[width] += n
        order = ("U8", "U16", "32", "64", "128")
        return " ".join(f"{w}:{widths[w]}" for w in order if widths[w]) or "-"

    return {
        "instructions": len(ops),
        "HGMMA": count("HGMMA"),
        "MUFU.EX2": count("MUFU.EX2"),
        "EX2 run": longest_run(ops, "MUFU.EX2"),
        "FFMA": count("FFMA"),
        "LDS": by_width("LDS"),
        "STS": by_width("STS"),
        "STSM": count("STSM"),
        "BAR": count("BAR.SYNC", "BAR.RED"),
        "BAR.ARV": count("BAR.ARV"),
        "local": count("LDL", "STL"),
    }


def registers(cubin: Path, cuobjdump: str | None) -> str:
    if cuobjdump is None:
        return "-"
    out = subprocess.run(
        [cuobjdump, "--dump-resource-usage", str(cubin)], capture_output=True, text=True
    ).stdout
    found = re.findall(r"REG:(\d+)", out)
    return "/".join(found) if found else "-"


def compile_cubin(family, problem, config, target, where: Path) -> Path:
    family.compile(
        problem, config, target, options=f"--keep-cubin --dump-dir {where}", use_cache=False
    )
    cubins = sorted(where.glob("*.cubin"))
    if len(cubins) != 1:
        raise RuntimeError(f"expected one cubin in {where}, found {len(cubins)}")
    return cubins[0]


def parse_problem(family, text: str):
    from benchmarks.sweep import parse_value

    fields = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if not value:
            raise ValueError(f"--problem wants name=value items (got {item!r})")
        try:
            fields[name.strip()] = parse_value(value.strip())
        except ValueError:  # a name: dtype=bf16
            fields[name.strip()] = value.strip()
    return family.problem_from_job(fields)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="128:16384:causal", help="head_dim:seqlen[:causal][:gN]")
    ap.add_argument("--problem", default=None, help="a job's problem fields: name=value,...")
    ap.add_argument("--backward", action="store_true", help="the backward's main kernel")
    ap.add_argument("--set", action="append", default=[], help="knob=value (repeatable)")
    ap.add_argument("--dump", default=None, help="keep each config's SASS under this folder")
    ap.add_argument("--nvdisasm", default=None)
    ap.add_argument("--cuobjdump", default=None)
    args = ap.parse_args(argv)

    nvdisasm = find_tool("nvdisasm", args.nvdisasm)
    if nvdisasm is None:
        print(
            "sass: no nvdisasm (install the CUDA toolkit or `pip install nvidia-cuda-nvdisasm`, "
            "or pass --nvdisasm PATH)",
            file=sys.stderr,
        )
        return 2
    cuobjdump = find_tool("cuobjdump", args.cuobjdump)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

    from benchmarks.ab import parse_changes
    from benchmarks.attention import parse_shape
    from fa4tune.kernels import get_kernel
    from fa4tune.target import get_target

    name = "fa4_bwd_sm90" if args.backward else "fa4_fwd_sm90"
    family = get_kernel(name)
    target = get_target("H200")
    try:
        problem = parse_problem(family, args.problem) if args.problem else parse_shape(args.shape)
        changes = parse_changes(args.set, name)
    except (ValueError, IndexError) as exc:
        print(f"sass: {exc}", file=sys.stderr)
        return 2
    default = family.default_config(problem, target)
    configs = [("default", default)]
    if changes:
        variant = replace(default, **changes)
        reasons = family.infeasible_reasons(problem, variant, target)
        if reasons:
            print(f"sass: {variant.short()} is infeasible: {'; '.join(reasons)}", file=sys.stderr)
            return 2
        configs.append(("default + " + " ".join(args.set), variant))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, config) in enumerate(configs):
            where = Path(tmp) / str(i)
            where.mkdir()
            cubin = compile_cubin(family, problem, config, target, where)
            sass = subprocess.run(
                [nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True
            ).stdout
            if args.dump:
                Path(args.dump).mkdir(parents=True, exist_ok=True)
                (Path(args.dump) / f"{config.short()}.sass").write_text(sass)
            rows.append(
                (label, config.short(), registers(cubin, cuobjdump), summarize(opcodes(sass)))
            )

    print(f"{name}, {problem.key()}, sm_90a (static SASS: each instruction once)\n")
    keys = list(rows[0][3])
    print("| config | | registers | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 3) + "|")
    for label, short, regs, counts in rows:
        cells = " | ".join(str(counts[k]) for k in keys)
        print(f"| {label} | {short} | {regs} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
