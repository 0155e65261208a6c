"""``kvoffload admin {lookup,pin,unpin,clear,warm,pins}``: operator controls over HTTP.

Talks to a ``kvoffload serve`` (its ``/admin`` endpoints) or a ``kvoffload route`` (the same
endpoints, fanned out to every backend) named by ``--url``; the API key comes from ``--api-key``
or ``$KVOFFLOAD_API_KEY``. Prints a short table (``--json``: the server's answer as is). Exit
status: 0 done; 2 bad input (the command line, or the server's 400); 1 refused or failed (a pin
over quota: 409; a wrong key: 401; the server unreachable). Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from kvoffload.cli.args import int_in, real_in

__all__ = ["add_parser", "run"]

API_KEY_ENV = "KVOFFLOAD_API_KEY"
_COMMANDS = ("lookup", "pin", "unpin", "clear", "warm", "pins")
_TIERS_HELP = "a tier (device, host, disk, remote); repeat for several"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    admin = subparsers.add_parser(
        "admin",
        help="operator controls of a server or router: lookup, pin, unpin, clear, warm, pins",
        description="Ask a kvoffload serve or route where a prompt's KV lives, pin it, clear "
        "tiers, warm the cache (docs/admin.md).",
    )
    admin.add_argument("--url", default="http://127.0.0.1:8000",
                       help="the server or router (default: %(default)s)")
    admin.add_argument("--api-key", metavar="KEY",
                       help=f"its API key (default: ${API_KEY_ENV}, else none)")
    admin.add_argument("--timeout", type=int_in(1, 3600), default=120, metavar="S",
                       help="seconds to wait for the answer (default: %(default)s)")
    admin.add_argument("--json", action="store_true", help="print the server's JSON answer")
    commands = admin.add_subparsers(dest="admin_command", required=True,
                                    metavar="{" + ",".join(_COMMANDS) + "}")

    def prompt_args(p: argparse.ArgumentParser, required: bool = True) -> None:
        p.add_argument("prompt", nargs="?", help="the prompt text")
        p.add_argument("--prompt-file", metavar="PATH", help="read the prompt text from PATH "
                       "('-': standard input)")
        p.add_argument("--token-ids", metavar="IDS", help="the prompt as token ids: 1,2,3")
        p.add_argument("--messages-file", metavar="PATH",
                       help="a JSON list of chat messages (rendered with the chat template)")
        p.set_defaults(prompt_required=required)

    lookup = commands.add_parser("lookup", help="leading tokens of a prompt held per tier")
    prompt_args(lookup)
    pin = commands.add_parser("pin", help="keep a prompt's blocks from eviction (computed "
                              "first if not cached)")
    prompt_args(pin)
    pin.add_argument("--tier", action="append", dest="tiers",
                     help="a tier to pin in (host, disk); repeat for both (default: host)")
    pin.add_argument("--owner", default="operator", help="the pin's owner label (default: %(default)s)")
    pin.add_argument("--ttl", type=real_in(0, positive=True), metavar="S", help="seconds until the pin lapses "
                     "(default: until unpinned)")
    unpin = commands.add_parser("unpin", help="release pins (by prompt, owner or id)")
    prompt_args(unpin, required=False)
    unpin.add_argument("--owner", help="only this owner's pins")
    unpin.add_argument("--id", dest="pin_id", help="the pin id (as `pins` lists it)")
    clear = commands.add_parser("clear", help="remove cached blocks (pinned ones stay)")
    clear.add_argument("--tier", action="append", dest="tiers", help=_TIERS_HELP)
    clear.add_argument("--all", action="store_true", help="every tier")
    clear.add_argument("--model", metavar="FINGERPRINT",
                       help="another model's namespace in the shared tiers (32 hex digits, as "
                       "lookup shows 'model'); default: the server's own model")
    clear.add_argument("--unpin", action="store_true", help="release the pins of those tiers "
                       "first, so their blocks go too")
    warm = commands.add_parser("warm", help="compute a prompt's KV into the tiers (one "
                               "prefill-only request), or promote it from disk/remote into host")
    prompt_args(warm)
    warm.add_argument("--tier", action="append", dest="tiers", help=_TIERS_HELP + " (default: all)")
    commands.add_parser("pins", help="list the pins and each tier's pinned quota")
    admin.set_defaults(func=run)


def _prompt_body(args: argparse.Namespace) -> dict[str, Any]:
    """The prompt fields of the request (``prompt`` or ``messages``); exits 2 on bad input."""
    given = [x for x in ("prompt", "prompt_file", "token_ids", "messages_file")
             if getattr(args, x, None) is not None]
    if len(given) > 1:
        _fail(2, "give one prompt: text, --prompt-file, --token-ids or --messages-file")
    if not given:
        if args.prompt_required:
            _fail(2, "a prompt is required: text, --prompt-file, --token-ids or --messages-file")
        return {}
    try:
        if args.token_ids is not None:
            return {"prompt": [int(t) for t in args.token_ids.split(",")]}
        if args.messages_file is not None:
            return {"messages": json.loads(_read(args.messages_file))}
        text = args.prompt if args.prompt is not None else _read(args.prompt_file)
    except (ValueError, OSError) as exc:
        _fail(2, f"cannot read the prompt: {exc}")
    if not text:
        _fail(2, "the prompt must not be empty")
    return {"prompt": text}


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    with open(path, encoding="utf-8") as f:
        return f.read()


def _request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    """``(method, path, body)`` of the command."""
    command = args.admin_command
    if command == "pins":
        return "GET", "/admin/pins", None
    body: dict[str, Any] = {}
    if command == "clear":
        if not args.tiers and not args.all:
            _fail(2, "name the tiers to clear (--tier, repeatable) or --all")
        if args.tiers and args.all:
            _fail(2, "--tier and --all exclude each other")
        if args.tiers:
            body["tiers"] = args.tiers
        if args.model is not None:
            body["model"] = args.model
        if args.unpin:
            body["unpin"] = True
        return "POST", "/admin/clear", body
    body.update(_prompt_body(args))
    if command == "pin":
        body["tiers"] = args.tiers or ["host"]
        body["owner"] = args.owner
        if args.ttl is not None:
            body["ttl_s"] = args.ttl
    elif command == "unpin":
        if args.owner is not None:
            body["owner"] = args.owner
        if args.pin_id is not None:
            body["id"] = args.pin_id
        if not body:
            _fail(2, "name what to unpin: a prompt, --owner or --id")
    elif command == "warm" and args.tiers:
        body["tiers"] = args.tiers
    return "POST", f"/admin/{command}", body


def run(args: argparse.Namespace) -> int:
    method, path, body = _request(args)
    key = args.api_key or os.environ.get(API_KEY_ENV, "")
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(args.url.rstrip("/") + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        status = exc.code
        try:
            error = json.loads(exc.read()).get("error", {})
            message = error.get("message") or str(exc)
            param = error.get("param")
        except ValueError:
            message, param = str(exc), None
        where = f" ({param})" if param else ""
        _fail(2 if status == 400 else 1, f"{status}: {message}{where}")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        _fail(1, f"cannot reach {args.url}: {reason}")
    if args.json:
        print(json.dumps(answer, indent=2, sort_keys=True))
    else:
        print(format_answer(args.admin_command, answer))
    return 0


def _fail(code: int, message: str) -> None:
    print(f"kvoffload admin: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def format_answer(command: str, answer: dict[str, Any]) -> str:
    """A short human reading of an answer (a router's: one block per backend)."""
    if "backends" in answer:
        parts = []
        for backend in answer["backends"]:
            head = f"== {backend.get('url')}"
            if backend.get("predicted_ttft_s") is not None:
                head += f"  predicted TTFT {backend['predicted_ttft_s'] * 1e3:.1f} ms"
            if backend.get("error"):
                parts.append(f"{head}\n  error: {backend['error']}")
                continue
            parts.append(head + "\n" + format_answer(command, backend.get("answer") or {}))
        return "\n".join(parts)
    if command in ("lookup", "warm"):
        lines = [f"prompt {answer['prompt_tokens']} tokens, cached {answer['cached_tokens']} "
                 f"(blocks of {answer['block_tokens']}); model {answer.get('model')}"]
        pinned = answer.get("pinned_tokens", {})
        for tier, tokens in answer["tiers"].items():
            extra = f"  pinned {pinned[tier]}" if pinned.get(tier) else ""
            lines.append(f"  {tier:<7} {tokens:>8}{extra}")
        if not answer.get("complete", True):
            lines.append("  (the remote tier did not answer every block in time)")
        return "\n".join(lines)
    if command == "pin":
        ttl = "until unpinned" if answer["expires_at"] is None else f"until {answer['expires_at']:.0f}"
        how = " (computed first)" if answer.get("computed") else ""
        return (f"pinned {answer['id']}: {answer['tokens']} tokens in {','.join(answer['tiers'])} "
                f"{ttl}{how}")
    if command == "unpin":
        gone = answer["unpinned"]
        return f"unpinned {len(gone)} pin(s)" + "".join(f"\n  {p['id']}" for p in gone)
    if command == "clear":
        removed = ", ".join(f"{t} {n}" for t, n in answer["removed_blocks"].items()) or "nothing"
        kept = ", ".join(f"{t} {n}" for t, n in answer.get("kept_pinned_blocks", {}).items() if n)
        refused = "".join(f"\n  {t}: {why}" for t, why in answer.get("refused", {}).items())
        return f"removed blocks: {removed}" + (f"; kept pinned: {kept}" if kept else "") + refused
    lines = [f"{len(answer['pins'])} pin(s); pinned/quota blocks: " + ", ".join(
        f"{t} {answer['pinned_blocks'][t]}/{q}" for t, q in answer["quota_blocks"].items())]
    for p in answer["pins"]:
        ttl = "-" if p["expires_at"] is None else f"expires {p['expires_at']:.0f}"
        lines.append(f"  {p['id']:<32} {p['tokens']:>7} tokens  {','.join(p['tiers']):<10} {ttl}")
    return "\n".join(lines)
