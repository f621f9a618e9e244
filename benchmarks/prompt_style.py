"""How prompt files compare in shape: words per prompt, questions, line breaks.

Target-written prompts (`eyas synthesize`) should read like the prompts a drafter is judged on;
this prints one table row per prompts JSONL (the user messages, read as `eyas synthesize` reads
them), e.g. the shipped and held-out prompts next to three synthesis modes:

    S=data/produce/prompts/default.jsonl
    eyas synthesize --target smollm2 --n 256 --out template.jsonl --exclude $S --batch-size 64 --seed 1
    eyas synthesize --target smollm2 --n 256 --out openers.jsonl --openers-from $S --exclude $S --batch-size 64 --seed 1
    eyas synthesize --target smollm2 --n 256 --out examples.jsonl --examples-from $S --exclude $S --batch-size 64 --seed 1
    python benchmarks/prompt_style.py data/produce/prompts/heldout.jsonl $S template.jsonl openers.jsonl examples.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics

from eyas.data.produce.synthesize import prompt_texts


def style(texts: list[str]) -> dict:
    """Median and mean words per prompt, and the shares that are short (<= 15 words), end in a
    question mark, or hold a line break."""
    words = [len(t.split()) for t in texts]
    n = len(texts)
    return dict(prompts=n, median_words=statistics.median(words),
                mean_words=round(statistics.mean(words), 1),
                short=round(sum(w <= 15 for w in words) / n, 2),
                question=round(sum(t.rstrip().endswith("?") for t in texts) / n, 2),
                line_break=round(sum("\n" in t for t in texts) / n, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="prompts JSONL files")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    rows = {f: style(prompt_texts(f)) for f in args.files}
    print("| prompts | n | median words | mean words | ≤ 15 words | ends in ? | line break |")
    print("|---|---|---|---|---|---|---|")
    for f, r in rows.items():
        print(f"| {f} | {r['prompts']} | {r['median_words']:g} | {r['mean_words']} | "
              f"{r['short']:.2f} | {r['question']:.2f} | {r['line_break']:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
