"""First request vs follow-up latency: what keeping a session resident buys.

For each of N sessions, sequentially and greedily (temperature 0, same max_tokens everywhere):
  1. first request: a distinct 336x336 image + a ~20-token question, opening a session
     (encodes the image and prefills ~600 tokens);
  2. M follow-ups in the session, ~15 new tokens each (only the new tokens are prefilled);
  3. the session is closed, then the same M follow-ups are sent stateless, each carrying the
     whole history so far (image, questions and the session's answers as returned): the
     vision tower and the whole prefill run again, what a server without sessions pays every
     turn. (Closed first, because while a session on the same image is open the server's
     image-embedding cache would spare stateless requests the vision tower.)
One warm-up request comes first and is not counted.
Each request is timed end to end on the client.

A text-only model (no vision tower in its config.json, or --no-images) gets a ~500-token document
instead of the image, so the first request still prefills a long prompt.

Run:  python -m benchmarks.first_vs_followup --start-server     (starts TorchServe on models/llava-bench)
      python -m benchmarks.first_vs_followup --start-server --model-path models/text-mistral
      python -m benchmarks.first_vs_followup --url http://127.0.0.1:8080
      python -m benchmarks.families      (this benchmark on every family's demo checkpoint, one table)
Writes <out>/first_vs_followup.json and <out>/first_vs_followup.png (default out: benchmarks/results).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import requests
from tqdm import tqdm

from benchmarks.common import (
    BENCH_MODEL,
    bar_chart,
    format_table,
    image_data_url,
    mean,
    median,
    percentile,
    server_url,
    write_json,
)

SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_HEADER = "X-Amzn-SageMaker-New-Session-Id"

FIRST_QUESTION = "Describe the colours and shapes in this picture in a few words."  # ~21 tokens
FOLLOWUP_QUESTIONS = [  # ~15 tokens each with this model's tokenizer
    "How many distinct regions of colour can you count here?",
    "Which corner of the picture looks the darkest?",
    "Describe the pattern in the centre in one short sentence.",
    "Is there more red or more blue in the image?",
]
WARMUP_SEED = 10_000  # not one of the measured images' seeds

FIRST, FOLLOWUP, STATELESS = "first", "followup", "stateless_followup"
ROW_LABELS = {FIRST: "first request", FOLLOWUP: "follow-up (session)", STATELESS: "follow-up (stateless)"}


class RequestFailed(RuntimeError):
    pass


@dataclass
class Sample:
    kind: str  # first | followup | stateless_followup
    session: int  # index of the session in this run
    turn: int  # 0 for the first request, k = 1..M for follow-up k
    seconds: float  # client-side, end to end
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    answer: str


@dataclass
class Reply:
    body: dict
    headers: requests.structures.CaseInsensitiveDict
    seconds: float


class Client:
    """Sequential JSON POSTs to one endpoint; a non-200 answer raises RequestFailed with its body."""

    def __init__(self, base_url: str, max_tokens: int):
        self.url = base_url + "/invocations"
        self.max_tokens = max_tokens
        self.http = requests.Session()

    def chat(self, messages: list[dict], session_id: str | None = None) -> Reply:
        body = {"messages": messages, "max_tokens": self.max_tokens, "temperature": 0}
        return self.post(body, session_id)

    def close(self, session_id: str) -> Reply:
        return self.post({"requestType": "CLOSE"}, session_id)

    def post(self, body: dict, session_id: str | None) -> Reply:
        headers = {SESSION_HEADER: session_id} if session_id else {}
        start = time.perf_counter()
        response = self.http.post(self.url, json=body, headers=headers, timeout=300)
        seconds = time.perf_counter() - start
        if response.status_code != 200:
            raise RequestFailed(f"POST {self.url} (session {session_id}) -> {response.status_code}: {response.text}")
        return Reply(body=response.json(), headers=response.headers, seconds=seconds)


def user_message(text: str, image_url: str | None = None) -> dict:
    content = [{"type": "image_url", "image_url": {"url": image_url}}] if image_url else []
    return {"role": "user", "content": content + [{"type": "text", "text": text}]}


def sample(kind: str, session: int, turn: int, reply: Reply) -> Sample:
    usage = reply.body["usage"]
    return Sample(kind=kind, session=session, turn=turn, seconds=reply.seconds,
                  prompt_tokens=usage["prompt_tokens"],
                  cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                  completion_tokens=usage["completion_tokens"],
                  answer=reply.body["choices"][0]["message"]["content"])


def document(seed: int) -> str:
    """A ~500-token text for text-only models' first request (what the image is for a VLM)."""
    colours, shapes = ("red", "green", "blue", "yellow", "grey"), ("square", "circle", "triangle", "star")
    return " ".join(f"Item {i}: a {colours[(seed + i) % 5]} {shapes[(seed * 3 + i) % 4]} of size {(seed + 7 * i) % 13}."
                    for i in range(40))


def opening_message(seed: int, images: bool) -> dict:
    if images:
        return user_message(FIRST_QUESTION, image_data_url(seed=seed))
    return user_message(f"{document(seed)}\n\n{FIRST_QUESTION}")


def run_session(client: Client, index: int, questions: list[str], progress: tqdm, images: bool) -> list[Sample]:
    """One session's first request, its follow-ups; closes it; then the same follow-ups stateless."""
    opening = opening_message(index, images)
    reply = client.chat([opening], session_id="NEW_SESSION")
    if NEW_SESSION_HEADER not in reply.headers:
        raise RequestFailed(f"opening request answered without a {NEW_SESSION_HEADER} header: {reply.body}")
    session_id = reply.headers[NEW_SESSION_HEADER].split(";", 1)[0].strip()  # "<id>; Expires=..."
    samples = [sample(FIRST, index, 0, reply)]
    progress.update()
    history = [opening, {"role": "assistant", "content": samples[0].answer}]
    for turn, question in enumerate(questions, start=1):
        samples.append(sample(FOLLOWUP, index, turn, client.chat([user_message(question)], session_id)))
        history += [user_message(question), {"role": "assistant", "content": samples[-1].answer}]
        progress.update()
    client.close(session_id)  # on an earlier failure the run stops; the session then expires by TTL
    for turn in range(1, len(questions) + 1):
        # History up to and including question `turn`: the opening pair + (turn - 1) pairs + question.
        samples.append(sample(STATELESS, index, turn, client.chat(history[:2 * turn + 1])))
        progress.update()
    return samples


def summarize(samples: list[Sample]) -> dict[str, dict]:
    summary = {}
    for kind in (FIRST, FOLLOWUP, STATELESS):
        rows = [s for s in samples if s.kind == kind]
        seconds = [s.seconds for s in rows]
        summary[kind] = {"n": len(rows), "median_s": median(seconds), "p90_s": percentile(seconds, 90),
                         "mean_prompt_tokens": mean([s.prompt_tokens for s in rows]),
                         "mean_cached_tokens": mean([s.cached_tokens for s in rows])}
    return summary


def count_answer_mismatches(samples: list[Sample]) -> tuple[int, int]:
    """(differing, compared): stateless follow-ups whose answer differs from the session's, among those
    whose prompt is as long as the session's. A stateless request re-sends the answers as text, which a
    tokenizer need not encode back to the ids the model wrote, so only these can be compared. A real
    checkpoint mostly writes its tokenizer's own split, so these nearly always carry the session's ids,
    and greedy answers must then be equal. A random demo model writes pieces that are not its
    tokenizer's split of their own text (on the Mistral demo ``▁COL`` and a lone byte ``<0xC0>`` came
    back as two other ids, the length unchanged), so there a difference can come from the prompt: the
    API returns no ids to tell (the engine's tests compare them)."""
    in_session = {(s.session, s.turn): s for s in samples if s.kind == FOLLOWUP}
    pairs = [(s, in_session[(s.session, s.turn)]) for s in samples if s.kind == STATELESS]
    compared = [(a, b) for a, b in pairs if a.prompt_tokens == b.prompt_tokens]
    return sum(a.answer != b.answer for a, b in compared), len(compared)


def report(summary: dict[str, dict], ratios: dict[str, float], mismatches: tuple[int, int]) -> str:
    headers = ["request", "n", "median s", "p90 s", "mean prompt tok", "mean cached tok"]
    rows = [[ROW_LABELS[k], v["n"], v["median_s"], v["p90_s"], round(v["mean_prompt_tokens"], 1),
             round(v["mean_cached_tokens"], 1)] for k, v in summary.items()]
    lines = [format_table(headers, rows), ""]
    lines += [f"{name} = {value:.2f}" for name, value in ratios.items()]
    lines.append(f"stateless answers differing from the session's (same prompt length): "
                 f"{mismatches[0]} of {mismatches[1]}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8080")
    where.add_argument("--start-server", action="store_true", help="start TorchServe on a free 127.0.0.1 port")
    parser.add_argument("--model-path", type=Path, default=BENCH_MODEL, help="model for --start-server")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--followups", type=int, default=4, help=f"at most {len(FOLLOWUP_QUESTIONS)}")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-images", action="store_true",
                        help="text-only first requests (automatic for a text-only --model-path)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.start_server and not has_vision(args.model_path):
        args.no_images = True
    if args.sessions < 1 or not 1 <= args.followups <= len(FOLLOWUP_QUESTIONS) or args.max_tokens < 1:
        parser.error(f"need --sessions >= 1, 1 <= --followups <= {len(FOLLOWUP_QUESTIONS)}, --max-tokens >= 1")
    return args


def has_vision(model_path: Path) -> bool:
    import json

    return "vision_config" in json.loads((model_path / "config.json").read_text())


def measure(base_url: str, args: argparse.Namespace) -> list[Sample]:
    client = Client(base_url, args.max_tokens)
    client.chat([opening_message(WARMUP_SEED, not args.no_images)])  # warm-up, not counted
    questions = FOLLOWUP_QUESTIONS[:args.followups]
    samples: list[Sample] = []
    with tqdm(total=args.sessions * (1 + 2 * args.followups), unit="req", desc="first_vs_followup") as progress:
        for index in range(args.sessions):
            samples += run_session(client, index, questions, progress, images=not args.no_images)
    return samples


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with server_url(args.url, start_server=args.start_server, model_path=args.model_path,
                        log_name="first_vs_followup.log") as base_url:
            samples = measure(base_url, args)
            settings = {"url": base_url, "started_server": args.start_server,
                        "model_path": str(args.model_path) if args.start_server else None,
                        "sessions": args.sessions, "followups": args.followups, "max_tokens": args.max_tokens,
                        "images": not args.no_images,
                        "temperature": 0,
                        # Other work on the machine inflates latencies; a high load here flags a noisy run.
                        "loadavg_1m_at_end": os.getloadavg()[0]}
    except RequestFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    summary = summarize(samples)
    first_s, followup_s, stateless_s = (summary[k]["median_s"] for k in (FIRST, FOLLOWUP, STATELESS))
    ratios = {"first_s / followup_s": first_s / followup_s,
              "stateless_followup_s / followup_s": stateless_s / followup_s}
    mismatches = count_answer_mismatches(samples)
    print(report(summary, ratios, mismatches))
    json_path = write_json(args.out / "first_vs_followup.json", {
        "first_s": first_s, "followup_s": followup_s, "stateless_followup_s": stateless_s,
        "ratios": ratios, "summary": summary, "stateless_answer_mismatches": mismatches[0],
        "stateless_answers_compared": mismatches[1],
        "settings": settings, "samples": [asdict(s) for s in samples],
    })
    png_path = bar_chart(args.out / "first_vs_followup.png", [ROW_LABELS[k] for k in summary],
                         [v["median_s"] for v in summary.values()], [v["p90_s"] for v in summary.values()],
                         title=f"First request vs follow-up ({args.max_tokens} new tokens, greedy)")
    print(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
