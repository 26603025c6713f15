"""First request vs follow-up for every model family, on each family's offline demo checkpoint.

Runs ``benchmarks.first_vs_followup --start-server`` once per checkpoint (its own TorchServe each time,
one after another) and prints one table: the median first request, session follow-up and stateless
follow-up, their ratios, and how many stateless answers differed from the session's where the
stateless prompt had the session's length (greedy on a real checkpoint: about 0; a random demo's may differ,
see first_vs_followup.count_answer_mismatches).
The demos are tiny random models of each family's architecture, so the ratios show what sessions
save in vision and prefill work per family, not the speed of a real checkpoint.

Run:  python -m benchmarks.families [--sessions 2] [--followups 3] [--only llava_next-mistral ...]
Writes <out>/families.json and each run's files under <out>/families/<name>/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks import first_vs_followup
from benchmarks.common import REPO, format_table, write_json


def checkpoints() -> dict[str, Path]:
    """Family name -> demo checkpoint, built on first use."""
    from launch.torchserve import ensure_demo_models
    from model_store import build_llava_next, build_qwen_vl, build_text_models

    ensure_demo_models(only=["tiny"])
    out = {"llava": REPO / "models" / "llava-tiny"}
    out |= {f"llava_next-{k}": v for k, v in build_llava_next.ensure().items()}
    out |= build_qwen_vl.ensure()
    out |= build_text_models.ensure()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--followups", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--only", nargs="*", help="family names (default: all)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    rows, results = [], {}
    for name, path in checkpoints().items():
        if args.only and name not in args.only:
            continue
        out = args.out / "families" / name
        code = first_vs_followup.main(["--start-server", "--model-path", str(path), "--sessions", str(args.sessions),
                                       "--followups", str(args.followups), "--max-tokens", str(args.max_tokens),
                                       "--out", str(out)])
        if code:
            print(f"error: {name} failed (exit {code}); see {out}", file=sys.stderr)
            return code
        result = json.loads((out / "first_vs_followup.json").read_text())
        results[name] = result
        summary = result["summary"]
        rows.append([name, round(summary["first"]["mean_prompt_tokens"]), result["first_s"], result["followup_s"],
                     result["stateless_followup_s"], round(result["ratios"]["first_s / followup_s"], 2),
                     round(result["ratios"]["stateless_followup_s / followup_s"], 2),
                     f"{result['stateless_answer_mismatches']} of {result['stateless_answers_compared']}"])
    print(format_table(["family (demo)", "first prompt tok", "first s", "follow-up s", "stateless s",
                        "first / follow-up", "stateless / follow-up", "answers differing (same prompt)"], rows))
    print(f"wrote {write_json(args.out / 'families.json', results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
