"""The `kvfuse` command line: demo, precompute, ask, serve, eval.

Bad input ends with one clear line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from importlib import resources
from pathlib import Path

__all__ = ["main"]


class CliError(Exception):
    """A user-facing error: printed as one line."""


def _engine(args):
    _check_model_args(args)
    # Model loads are local-only (local_files_only=True in kvfuse.engine.weights): no HF_HUB_OFFLINE needed.
    from kvfuse.engine.api import FusionEngine

    threads = getattr(args, "threads", None)
    if threads:
        import torch

        torch.set_num_threads(threads)
    config = {}
    redis_url = getattr(args, "redis_url", None)
    if redis_url:
        config["redis_url"] = redis_url
    budget = getattr(args, "memory_budget", None)
    if budget is not None:
        config["memory_budget_bytes"] = _size(budget, "--memory-budget")
    share = _gpu_share(args)
    if share is not None:
        config["gpu_memory_share"] = share
    cold = getattr(args, "cold_documents", None)
    if cold is not None:
        config["cold_documents"] = cold
    for name in ("guard_margin", "guard_tokens", "guard_at"):
        if getattr(args, name, None) is not None:
            config[name] = getattr(args, name)
    if getattr(args, "idle_captures", False):
        config["idle_captures"] = True
    return FusionEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                        cache_dir=args.cache_dir, disk_cache=not getattr(args, "no_disk_cache", False),
                                        adapter=_adapter_arg(getattr(args, "adapter", None)),
                                        links=_adapter_arg(getattr(args, "links", None)), **config)


def _adapter_arg(value):
    """--adapter or --links: "auto" (the default, also for commands without the option), "none", "packaged" or a
    file path (resolved and checked by `from_pretrained`)."""
    return "auto" if value is None else value


#: the share of a GPU `kvfuse serve` fills with its pool unless told otherwise (EngineConfig.gpu_memory_share)
SERVE_GPU_SHARE = 0.8

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def _gpu_share(args) -> float | None:
    """`--gpu-memory-share` (serve): the share given; by default 0.8, unless `--memory-budget` sized the documents
    (a number given by hand wins); 0 turns the share off. Other commands: None."""
    if not hasattr(args, "gpu_memory_share"):
        return None
    share = args.gpu_memory_share
    if share is None:
        return None if args.memory_budget is not None else SERVE_GPU_SHARE
    if not 0.0 <= share <= 1.0:
        raise CliError(f"--gpu-memory-share must be in [0, 1] (0: off), got {share}")
    return share or None


def _size(text: str, name: str) -> int:
    """A byte size: a number with an optional binary unit (512K, 64M, 4G, 1.5GiB)."""
    s = text.strip().upper()
    digits = s.rstrip("BKMGTI")
    unit = s[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not value >= 0 or value != value or value == float("inf"):
        raise CliError(f"{name} must be a size such as 300K, 64M or 4G, got {text!r}")
    return int(value * _UNITS[unit])


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from kvfuse.engine.api import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registry name (qwen2.5-coder-0.5b, smollm2-135m, qwen2.5-coder-1.5b), a .gguf file or a "
                        f"Hugging Face model folder (default: {DEFAULT_MODEL})")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="default: bf16 on CUDA and on CPUs with native bf16, else fp32")
    p.add_argument("--cache-dir", default=None, help="converted weights and document caches "
                                                     "(default: $KVFUSE_CACHE_DIR or ~/.cache/kvfuse)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--adapter", default="auto",
                   help="fusion adapter: 'auto' (default: the one shipped for the model, if any), 'none', 'packaged' "
                        "(shipped for the model, or an error), or a .safetensors file from `kvfuse train-adapter`")
    p.add_argument("--links", default="auto",
                   help="link rows after every cached document of a fused prompt: 'auto' (default: those shipped "
                        "for the model, if any), 'none', 'packaged', or a .safetensors file from `kvfuse train-links`")
    p.add_argument("--redis-url", default=os.environ.get("KVFUSE_REDIS_URL") or None,
                   help="a Redis server shared by several engines as a cache tier behind memory and disk, e.g. "
                        "redis://host:6379/0 (default: $KVFUSE_REDIS_URL, else none; needs the redis extra)")


def _add_gen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", default=None,
                   help="fusion strategy (default: the engine's, kvfuse.engine.fusion.DEFAULT_STRATEGY: infoflow)")
    p.add_argument("--ratio", type=float, default=0.15, help="recompute ratio in [0, 1] (default 0.15)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)


def _strategy(args: argparse.Namespace) -> str:
    from kvfuse.engine.fusion import DEFAULT_STRATEGY

    return args.strategy or DEFAULT_STRATEGY


def _kind(value) -> str:
    """A JSON value's kind, for messages."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _parse_json(text: str, where: str, line_offset: int = 0):
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise CliError(f"{where}: not valid JSON ({e.msg} at line {e.lineno + line_offset} column {e.colno})"
                       ) from None
    except ValueError as e:  # NaN / Infinity
        raise CliError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise CliError(f"{where}: not valid JSON (nested too deeply)") from None


def _load_docs(path: str) -> list[dict]:
    """Documents from JSON or JSONL: objects with id/text (title optional), or eval records with passages.

    Everything is checked here, before any model is loaded: a problem is one CliError naming the file, the line
    (JSONL, counting every line of the file) or the item (JSON), and what is wrong. A document id used twice must
    carry the same text both times (else one of them would be silently dropped).
    """
    from kvfuse.engine.types import Document

    p = Path(path)
    if not p.exists():
        raise CliError(f"no such file: {path}")
    if not p.is_file():
        raise CliError(f"{path}: not a regular file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise CliError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise CliError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    rows: list[tuple[str, object]] = []
    if p.suffix.lower() in (".jsonl", ".ndjson"):
        for n, line in enumerate(text.split("\n"), 1):  # only \n ends a record: U+2028 & co. are legal in JSON
            if line.strip():
                rows.append((f"{path}:{n}", _parse_json(line, f"{path}:{n}", line_offset=n - 1)))
    else:
        data = _parse_json(text, path)
        if isinstance(data, dict) and "documents" in data:
            data, what = data["documents"], "'documents'"
        else:
            what = "the top level"
        if not isinstance(data, list):
            raise CliError(f"{path}: {what} must be a list of documents or records (or an object with a "
                           f"'documents' list), got {_kind(data)}")
        rows = [(f"{path}: item {i + 1}", r) for i, r in enumerate(data)]
    docs: dict[str, dict] = {}
    first_seen: dict[str, str] = {}
    for where, r in rows:
        if not isinstance(r, dict):
            raise CliError(f"{where}: expected an object (id/text, or a record with passages), got {_kind(r)}")
        if "passages" in r:
            passages = r["passages"]
            if not isinstance(passages, list):
                raise CliError(f"{where}: 'passages' must be a list, got {_kind(passages)}")
            items = [(f"{where}: passage {j + 1}", d) for j, d in enumerate(passages)]
        else:
            items = [(where, r)]
        for w, d in items:
            if not isinstance(d, dict):
                raise CliError(f"{w}: expected an object with id/text, got {_kind(d)}")
            if "text" not in d:
                raise CliError(f"{w}: has no 'text' (expected id/text, or records with passages)")
            text, title, did = d["text"], d.get("title") or "", d.get("id")
            if not isinstance(text, str):
                raise CliError(f"{w}: 'text' must be a string, got {_kind(text)}")
            if not isinstance(title, str):
                raise CliError(f"{w}: 'title' must be a string, got {_kind(title)}")
            if did is None or did == "":
                did = f"{p.stem}-{len(docs)}"
            elif isinstance(did, bool) or not isinstance(did, (str, int, float)):
                raise CliError(f"{w}: 'id' must be a string or a number, got {_kind(did)}")
            did = str(did)
            try:
                Document(did, text, title.strip())  # the engine's own checks, now
            except ValueError as e:
                raise CliError(f"{w}: {e}") from None
            doc = {"id": did, "text": text, "title": title}
            if did in docs and docs[did] != doc:
                raise CliError(f"{w}: document id {did!r} is also used by {first_seen[did]} with a different text")
            docs[did] = doc
            first_seen.setdefault(did, w)
    if not docs:
        raise CliError(f"{path}: no documents found")
    return list(docs.values())


def _check_model_args(args) -> None:
    """Checks the model options that can be checked without loading anything."""
    from kvfuse.engine.validate import check_dir_path

    cache_dir = getattr(args, "cache_dir", None)
    if cache_dir is not None:
        check_dir_path(Path(cache_dir).expanduser(), "--cache-dir")
    elif os.environ.get("KVFUSE_CACHE_DIR"):
        check_dir_path(Path(os.environ["KVFUSE_CACHE_DIR"]).expanduser(), "$KVFUSE_CACHE_DIR")
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise CliError(f"--threads must be >= 1, got {threads}")
    redis_url = getattr(args, "redis_url", None)
    if redis_url:
        from kvfuse.engine.validate import check_redis_url

        check_redis_url(redis_url, "--redis-url")


def _check_gen_args(args) -> None:
    """The generation options, checked as the engine will check them, before the model is loaded."""
    from kvfuse.engine.validate import check_int, check_real

    check_real(args.ratio, "--ratio", low=0.0, high=1.0)
    check_int(args.max_new_tokens, "--max-new-tokens", minimum=1)
    check_real(args.temperature, "--temperature", low=0.0)
    if args.strategy is not None:
        from kvfuse.engine.fusion import make_strategy

        make_strategy(args.strategy)


def cmd_demo(args) -> int:
    from kvfuse.engine.types import as_documents

    data = json.loads(resources.files("kvfuse").joinpath("data/demo.json").read_text(encoding="utf-8"))
    from kvfuse.engine.validate import check_real

    try:
        guard = check_real(args.demo_guard, "--guard (a margin in nats)", low=0.0)
    except ValueError as e:
        raise CliError(str(e)) from None
    args.no_disk_cache = True
    _check_model_args(args)
    _check_gen_args(args)
    print(f"loading {args.model} ...", flush=True)
    engine = _engine(args)
    docs = {d.id: d for d in as_documents(data["documents"])}
    rep = engine.precompute(list(docs.values()))
    from kvfuse.engine.adapter import describe

    print(f"model {engine.model_name} on {engine.device} ({str(engine.dtype).replace('torch.', '')}); fusion "
          f"adapter {'none' if engine.adapter is None else describe(engine.adapter)}; "
          f"precomputed {rep.misses} documents ({rep.tokens} tokens) in {rep.seconds:.2f} s\n")
    for q in data["questions"]:
        qdocs = [docs[i] for i in q["docs"]]
        print(f"Q: {q['question']}   [{len(qdocs)} documents]")
        answers = []
        runs = [("full", 0.0), (_strategy(args), 0.0)] + ([(_strategy(args), guard)] if guard > 0 else [])
        for strat, margin in runs:
            r = engine.generate(q["question"], qdocs, strategy=strat, recompute_ratio=args.ratio,
                                max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                guard_margin=margin)
            label = strat if strat == "full" else f"{strat}@{args.ratio:.0%}" + (f" guard {margin:g}" if margin else "")
            g = r.extra.get("guard")
            how = "" if not margin else ("   (guard not tripped)" if g is None else
                                         f"   (handed to full prefill at token {g['escalated_at']})")
            print(f"  {label:<22} ttft {r.ttft_s * 1000:7.0f} ms   recomputed {r.recomputed_tokens:4d}/"
                  f"{r.doc_tokens} doc tokens   hits {r.cache_hits}/{len(qdocs)}   -> {r.text.strip()!r}{how}")
            answers.append(r.text.strip())
        if answers[1] != answers[0]:
            print("  note: the fused answer differs from full prefill's (fusion trades exactness for speed; "
                  "a higher --ratio or a guard moves it closer)")
        if len(answers) > 2 and answers[2] != answers[0]:
            print("  note: the guarded answer differs from full prefill's too (its near-ties were above the margin)")
        print()
    return 0


def _precompute_input(args) -> str:
    if args.file and args.input and args.file != args.input:
        raise CliError(f"two inputs given ({args.file} and --input {args.input}): give one")
    path = args.file or args.input
    if not path:
        raise CliError("no input: give the documents file (kvfuse precompute FILE, or --input FILE)")
    return path


def cmd_precompute(args) -> int:
    path = _precompute_input(args)
    if args.ray:
        return _precompute_on_ray(args, path)
    for flag, value in (("--address", args.address), ("--num-workers", args.num_workers),
                        ("--batch-size", args.batch_size)):
        if value is not None:
            raise CliError(f"{flag} needs --ray")
    if args.format not in ("auto", "json", "jsonl"):
        raise CliError(f"--format {args.format} needs --ray (without it: JSON or JSONL)")
    docs = _load_docs(path)
    _check_model_args(args)
    engine = _engine(args)
    progress = getattr(args, "progress", None)
    progress = _stderr_is_tty() if progress is None else progress
    rep = engine.precompute(docs, show_progress=progress)
    print(f"{len(docs)} documents: {rep.misses} computed ({rep.tokens} tokens), {rep.hits} already cached; "
          f"{rep.seconds:.2f} s; cache at {engine.config.disk_cache_dir}"
          + (f" and {_redacted(engine.config.redis_url)}" if engine.config.redis_url else ""))
    return 0


def _redacted(url: str) -> str:
    from kvfuse.engine.store.redis_tier import redact_url

    return redact_url(url)


def _precompute_on_ray(args, path: str) -> int:
    """`kvfuse precompute --ray`: the corpus is checked here, then precomputed by a Ray Data job (an actor pool of
    engines writing the shared disk cache); a progress bar, then the totals and throughput on stdout."""
    if getattr(args, "no_disk_cache", False):
        raise CliError("--ray writes the shared disk cache")
    _check_model_args(args)
    try:
        from kvfuse.distributed.ray_precompute import precompute_corpus, read_corpus
    except ImportError as e:  # pragma: no cover - the module itself imports no optional package
        raise CliError(f"kvfuse precompute --ray needs the distributed extra: {e}") from None
    read_corpus(path, args.format)  # every problem of the input, before Ray is started or imported
    try:
        import ray  # noqa: F401
    except ImportError:
        raise CliError("kvfuse precompute --ray needs Ray: pip install 'kvfuse[distributed]'") from None
    progress = getattr(args, "progress", None)
    progress = _stderr_is_tty() if progress is None else progress
    ray_log = logging.getLogger("ray.data")
    level = ray_log.level
    ray_log.setLevel(max(level, logging.WARNING))  # its per-job INFO lines; the bar and the summary say it
    try:
        rep = precompute_corpus(path, model=args.model, cache_dir=args.cache_dir, num_workers=args.num_workers,
                                batch_size=args.batch_size or 32, address=args.address, format=args.format,
                                device=args.device, dtype=args.dtype, threads_per_worker=args.threads,
                                show_progress=progress)
    finally:
        ray_log.setLevel(level)
    print(rep.summary())
    return 0


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def cmd_ask(args) -> int:
    from kvfuse.engine.validate import check_text

    check_text(args.question, "the question")
    docs = _load_docs(args.docs) if args.docs else []
    if args.doc_ids:
        wanted = [x for x in args.doc_ids.split(",") if x]
        by_id = {d["id"]: d for d in docs}
        missing = [x for x in wanted if x not in by_id]
        if missing:
            raise CliError(f"unknown document ids: {', '.join(missing)}")
        docs = [by_id[x] for x in wanted]
    _check_model_args(args)
    _check_gen_args(args)
    engine = _engine(args)
    stream = engine.stream(args.question, docs, strategy=_strategy(args), recompute_ratio=args.ratio,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    if args.json:
        for _ in stream:
            pass
        print(json.dumps(stream.result.as_dict(), indent=2))
        return 0
    for delta in stream:
        print(delta, end="", flush=True)
    r = stream.result
    g = r.extra.get("guard")
    guard = "" if g is None else (f", guard: {g['requested']} handed to full prefill at token {g['escalated_at']}"
                                  + (" (read at the question probe)" if g.get("at") == "probe" else ""))
    print(f"\n\n[{r.strategy} ttft {r.ttft_s * 1000:.0f} ms, recomputed {r.recomputed_tokens}/{r.doc_tokens} doc "
          f"tokens, cache hits {r.cache_hits} misses {r.cache_misses}{guard}]", file=sys.stderr)
    return 0


def _ratios(text: str, flag: str) -> list[float]:
    """Comma-separated recompute ratios, each in [0, 1]."""
    try:
        ratios = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise CliError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not ratios or any(not 0.0 <= r <= 1.0 for r in ratios):
        raise CliError(f"{flag} must be numbers in [0, 1], got {text!r}")
    return ratios


def _span(value: str, flag: str, minimum: int) -> tuple[int, int]:
    """A "LO:HI" range of token counts (or one count N, meaning N:N)."""
    from kvfuse.engine.validate import check_int

    parts = value.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None:
        raise CliError(f"{flag}: expected LO:HI token counts (e.g. 1024:8192), got {value!r}")
    check_int(lo, flag, minimum=minimum)
    check_int(hi, flag, minimum=minimum)
    if lo > hi:
        raise CliError(f"{flag}: {value!r} is not (shortest):(longest)")
    return lo, hi


def _warmup_args(args) -> dict | None:
    """`FusionEngine.warmup`'s arguments from serve's --warmup options (None without --warmup), checked before the
    model loads."""
    if args.warmup is None:
        if args.warmup_strategies or args.warmup_questions or args.warmup_ratios:
            raise CliError("--warmup-strategies, --warmup-questions and --warmup-ratios need --warmup LO:HI")
        return None
    from kvfuse.engine.fusion import DEFAULT_STRATEGY, make_strategy

    names = [n.strip() for n in (args.warmup_strategies or DEFAULT_STRATEGY).split(",") if n.strip()]
    for n in names:
        try:
            make_strategy(n)
        except ValueError as e:
            raise CliError(f"--warmup-strategies: {e}") from None
    ratios = _ratios(args.warmup_ratios or "0.15", "--warmup-ratios")
    return dict(contexts=_span(args.warmup, "--warmup", 64),
                question_tokens=_span(args.warmup_questions or "16:128", "--warmup-questions", 1),
                strategies=names, ratios=ratios)


def cmd_serve(args) -> int:
    try:
        from kvfuse.server import create_app, serve
    except ImportError as e:
        raise CliError(f"kvfuse serve needs the serve extra (pip install 'kvfuse[serve]'): {e}") from None
    from kvfuse.engine.validate import check_int, check_real

    check_int(args.port, "--port", minimum=0, maximum=65535)
    check_int(args.max_pending, "--max-pending", minimum=1)
    check_int(args.max_tokens, "--max-tokens", minimum=1)
    check_real(args.shutdown_timeout, "--shutdown-timeout", low=0.0)
    if args.memory_budget is not None:
        _size(args.memory_budget, "--memory-budget")
    _gpu_share(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get("KVFUSE_API_KEY") or None
    warm = _warmup_args(args)  # checked before the model loads
    docs = _load_docs(args.documents) if args.documents else []
    _check_model_args(args)
    front = None
    if args.front:
        from kvfuse.engine.auto import Front

        front = Front.load(args.front)  # checked before the model loads
    print(f"kvfuse: loading {args.model} ...", file=sys.stderr, flush=True)
    engine = _engine(args)
    if front is not None:
        engine.front = front
    if docs:
        rep = engine.precompute(docs)
        print(f"kvfuse: {len(docs)} documents: {rep.misses} computed, {rep.hits} already cached", file=sys.stderr,
              flush=True)
    warmed = None
    if warm is not None:
        warmed = engine.warmup(**warm)
        if warmed["requests"]:
            print(f"kvfuse: warm-up: {warmed['requests']} requests, {warmed['captured']} prefill graphs captured in "
                  f"{warmed['seconds']:.1f} s", file=sys.stderr, flush=True)
        else:
            print("kvfuse: warm-up: nothing to capture (no CUDA graphs on this device)", file=sys.stderr, flush=True)
    app = create_app(engine, model_name=args.served_model_name, api_key=api_key, max_pending=args.max_pending,
                     default_max_tokens=args.max_tokens, owns_engine=True)
    app.state.kvfuse.warmup = warmed
    if docs:  # requests may name them by id
        from kvfuse.engine.types import as_documents

        app.state.kvfuse.documents.update((d.id, d) for d in as_documents(docs))
    serve(app, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)
    return 0


def cmd_route(args) -> int:
    try:
        from kvfuse.server.router import create_router_app
        from kvfuse.server.run import serve
    except ImportError as e:
        raise CliError(f"kvfuse route needs the serve extra (pip install 'kvfuse[serve]'): {e}") from None
    from kvfuse.engine.validate import check_int, check_real

    check_int(args.port, "--port", minimum=0, maximum=65535)
    check_int(args.vnodes, "--vnodes", minimum=1)
    check_int(args.max_in_flight, "--max-in-flight", minimum=1)
    check_real(args.health_interval, "--health-interval", low=0.01)
    check_real(args.shutdown_timeout, "--shutdown-timeout", low=0.0)
    for url in args.replica:
        if not url.startswith(("http://", "https://")):
            raise CliError(f"--replica must be a URL such as http://10.0.0.5:8000, got {url!r}")
    app = create_router_app(args.replica, policy=args.policy, vnodes=args.vnodes, max_in_flight=args.max_in_flight,
                            health_interval_s=args.health_interval, seed=args.seed)
    serve(app, host=args.host, port=args.port, shutdown_timeout=args.shutdown_timeout, log_level=args.log_level)
    return 0


def cmd_train_adapter(args) -> int:
    from kvfuse.engine.validate import check_int, check_real
    from kvfuse.evaluation.runner import load_engine
    from kvfuse.training.distill import TrainConfig, train_adapter

    _check_training_args(args)
    check_int(args.rank, "--rank", minimum=1)
    check_int(args.batch, "--batch", minimum=1)
    check_real(args.max_seconds, "--max-seconds", low=0.0, high=1e7)
    check_real(args.first_token_weight, "--first-token-weight", low=1e-3, high=1e3)
    check_real(args.checkpoint_every, "--checkpoint-every", low=0.0, high=1e7)
    check_int(args.context_docs, "--context-docs", minimum=1, maximum=16)
    ratios = tuple(_ratios(args.ratios, "--ratios"))
    from kvfuse.engine.fusion import available, make_strategy

    if args.strategy not in available() or not make_strategy(args.strategy).uses_cache:
        raise CliError(f"--strategy must be a strategy that reads caches (one of {', '.join(available())} but full "
                       f"and sift), got {args.strategy!r}")
    if not str(args.out).endswith(".safetensors"):
        raise CliError(f"--out must name a .safetensors file, got {args.out!r}")
    targets = tuple(t for t in args.targets.split(",") if t)
    datasets, train, held = _training_split(args)
    cfg = TrainConfig(rank=args.rank, targets=targets, steps=args.steps, lr=args.lr, seed=args.seed,
                      max_doc_tokens=args.max_doc_tokens, stage=args.stage, batch=args.batch,
                      max_seconds=args.max_seconds, ratios=ratios, strategy=args.strategy,
                      checkpoint_seconds=args.checkpoint_every, eval_every=args.eval_every,
                      eval_prompts=args.eval_prompts, first_token_weight=args.first_token_weight,
                      doc_context=args.doc_context, context_docs=args.context_docs)
    _check_model_args(args)
    engine = load_engine(args.model, device=args.device, dtype=args.dtype, prompt=args.prompt, adapter=None)
    print(f"kvfuse: training a fusion adapter for {engine.model_name} on {len(train)} examples "
          f"({', '.join(datasets)}, after the first {args.reported} of each), {args.steps} steps", file=sys.stderr)
    try:
        rec = train_adapter(engine, train, cfg, args.out, log=lambda m: print(m, file=sys.stderr, flush=True),
                            resume=args.resume, eval_examples=held or None)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    _write_record(args, rec, datasets, train, held, "train-adapter")
    return 0


def _add_training_args(p: argparse.ArgumentParser, steps: int, lr: float) -> None:
    """The data and optimisation options every training command takes."""
    p.add_argument("--data", required=True, help="folder of evaluation JSONL files (the dev data)")
    p.add_argument("--datasets", default="2wikimqa,hotpotqa,musique", help="datasets to train on (comma separated)")
    p.add_argument("--reported", type=int, default=60,
                   help="the first N examples per dataset of the evaluation's seeded order are the reported split "
                        "and are never trained on (default 60, `kvfuse eval --limit 60`)")
    p.add_argument("--seed", type=int, default=0, help="training seed; the reported split uses `kvfuse eval`'s seed 0")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--lr", type=float, default=lr)


def _check_training_args(args) -> None:
    """The options every training command takes, checked before any model work."""
    from kvfuse.engine.validate import check_int, check_real

    check_int(args.steps, "--steps", minimum=1)
    check_int(args.reported, "--reported", minimum=0)
    check_int(args.max_doc_tokens, "--max-doc-tokens", minimum=16)
    check_real(args.lr, "--lr", low=1e-8, high=1.0)
    check_int(args.holdout, "--holdout", minimum=0)
    check_int(args.eval_every, "--eval-every", minimum=0)
    check_int(args.eval_prompts, "--eval-prompts", minimum=1)
    if bool(args.holdout) != bool(args.eval_every):
        raise CliError("--holdout and --eval-every go together (held-out examples, and how often to measure them)")


def _training_split(args):
    """(datasets, training examples, held-out examples) of a training command: everything after the reported split
    of each dataset, in the evaluation's own seeded order, the first `--holdout` of it held out."""
    from kvfuse.evaluation.data import read_jsonl, select_examples

    datasets = [d for d in args.datasets.split(",") if d]
    examples = read_jsonl(args.data)
    train, held = [], []
    for name in datasets:
        order = select_examples(examples, datasets=[name], limit=None, seed=0)
        if not order:
            raise CliError(f"dataset {name!r} has no examples under {args.data}")
        held.extend(order[args.reported:args.reported + args.holdout])
        train.extend(order[args.reported + args.holdout:])
    if not train:
        raise CliError("no training examples left after the reported split")
    return datasets, train, held


def _write_record(args, rec: dict, datasets, train, held, command: str) -> None:
    rec["data"] = {"folder": str(args.data), "datasets": datasets, "reported_per_dataset": args.reported,
                   "held_out_per_dataset": args.holdout, "held_out_ids": [ex.id for ex in held],
                   "train_ids": [ex.id for ex in train]}
    rec["command"] = f"kvfuse {command} " + " ".join(sys.argv[2:])
    import pathlib

    pathlib.Path(args.out).with_suffix(".json").write_text(json.dumps(rec, indent=1))


def cmd_train_links(args) -> int:
    from kvfuse.engine.validate import check_int
    from kvfuse.evaluation.runner import load_engine
    from kvfuse.training.links import LinksConfig, train_links

    _check_training_args(args)
    check_int(args.k, "--k", minimum=1, maximum=64)
    ratios = tuple(_ratios(args.ratios, "--ratios"))
    from kvfuse.engine.fusion import available, make_strategy
    from kvfuse.engine.links import applies_to

    if args.strategy not in available() or not applies_to(make_strategy(args.strategy)):
        raise CliError(f"--strategy must be a strategy that reads caches in place (one of {', '.join(available())} "
                       f"but full, sift and coinrag), got {args.strategy!r}")
    if not str(args.out).endswith(".safetensors"):
        raise CliError(f"--out must name a .safetensors file, got {args.out!r}")
    datasets, train, held = _training_split(args)
    cfg = LinksConfig(k=args.k, steps=args.steps, lr=args.lr, seed=args.seed, ratios=ratios, strategy=args.strategy,
                      max_doc_tokens=args.max_doc_tokens, eval_every=args.eval_every, eval_prompts=args.eval_prompts)
    _check_model_args(args)
    engine = load_engine(args.model, device=args.device, dtype=args.dtype, prompt=args.prompt, adapter=args.adapter,
                         links=None)
    print(f"kvfuse: training {args.k} link rows for {engine.model_name} on {len(train)} examples "
          f"({', '.join(datasets)}, after the first {args.reported} of each), {args.steps} steps", file=sys.stderr)
    try:
        rec = train_links(engine, train, cfg, args.out, log=lambda m: print(m, file=sys.stderr, flush=True),
                          eval_examples=held or None)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    _write_record(args, rec, datasets, train, held, "train-links")
    return 0


def cmd_front(args) -> int:
    """Builds a measured front (strategy="auto") from a kvfuse eval summary and TTFT sources."""
    from kvfuse.engine.auto import build_front

    rel = {}
    for item in args.rel:
        dev, sep, src = item.partition("=")
        if not sep or not dev or not src:
            raise CliError(f"--rel takes DEVICE=SOURCE (e.g. cpu=runs/x/summary.csv), got {item!r}")
        rel.setdefault(dev, []).append(src)  # repeated: the first source that measured a point wins
    if not rel:
        raise CliError("give at least one --rel DEVICE=SOURCE (where the relative TTFT comes from)")
    name, _, ratio = args.default.partition("@")
    try:
        default = (name, float(ratio) if ratio else 0.15)
    except ValueError:
        raise CliError(f"--default takes STRATEGY@RATIO, got {args.default!r}") from None
    adapter = args.adapter
    if adapter not in ("", "none") and not re.fullmatch(r"[0-9a-f]{16}", adapter):  # a name or a file
        from kvfuse.engine.adapter import load_adapter, resolve_adapter

        path = resolve_adapter(adapter, args.model)
        adapter = load_adapter(path).digest[:16] if path is not None else ""
    shares = {}
    for item in args.probe_share or []:
        dev, sep, val = item.partition("=")
        try:
            share = float(val)
        except ValueError:
            share = -1.0
        if not sep or not dev or not 0.0 < share <= 1.0:
            raise CliError(f"--probe-share takes DEVICE=SHARE with a share in (0, 1], got {item!r}")
        shares[dev] = share
    front = build_front(args.quality, rel, model=args.model, adapter="" if adapter == "none" else adapter,
                        default=default, datasets=args.datasets.split(",") if args.datasets else None,
                        guarded=args.guarded, probe_share=shares)
    front.save(args.out)
    for p in front.points:
        rels = ", ".join(f"{d} {r:.3f}" for d, r in sorted(p.rel_ttft.items()))
        where = "question probe" if p.guard_at == "probe" else "first token"
        guard = f" + guard {p.guard:g} nats ({where})" if p.guard else ""
        print(f"{p.strategy:>12} @ {p.ratio:<5g}{guard} fidelity {p.fidelity:.3f}  relative TTFT {rels or '1'}")
    print(f"wrote {args.out} (model {front.model}, adapter {front.adapter or 'none'}, default {front.default})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfuse", description="Fast RAG answers from fused per-document KV caches.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="answer a few questions over a bundled document set, full vs fused")
    _add_model_args(p)
    _add_gen_args(p)
    p.add_argument("--guard", type=float, default=0.5, dest="demo_guard", metavar="NATS",
                   help="also answer with this guard margin (GenerationOptions.guard_margin; 0: no guarded row; "
                        "default 0.5)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("precompute", help="compute and store document caches from a JSON/JSONL file (or, with "
                                          "--ray, a corpus on a Ray cluster)")
    p.add_argument("file", nargs="?", help="JSONL of {id, text[, title]} (or records with 'passages'), or JSON list")
    p.add_argument("--input", default=None, help="the documents file (instead of FILE); with --ray also Parquet, "
                                                 "a folder of JSONL/Parquet files or a LlamaIndex docstore.json")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show a progress bar on stderr (default: only when stderr is a terminal)")
    g = p.add_argument_group("distributed (needs the distributed extra)")
    g.add_argument("--ray", action="store_true", help="run as a Ray Data job: an actor pool of engines (one per "
                                                      "GPU, else CPU actors) writing the shared disk cache")
    g.add_argument("--address", default=None, help="Ray cluster to join ('auto', 'ray://host:10001'; default: "
                                                   "start a local one)")
    g.add_argument("--num-workers", type=int, default=None, help="engines (default: one per GPU, else one per "
                                                                 "8 CPUs)")
    g.add_argument("--batch-size", type=int, default=None, help="documents per precompute call (default 32)")
    g.add_argument("--format", default="auto", choices=["auto", "jsonl", "json", "parquet", "llama-index"],
                   help="input format (default: from the file name)")
    _add_model_args(p)
    p.set_defaults(func=cmd_precompute)

    p = sub.add_parser("ask", help="answer one question over documents")
    p.add_argument("question")
    p.add_argument("--docs", help="JSON/JSONL file of documents")
    p.add_argument("--doc-ids", help="comma-separated ids to use from --docs, in this order")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    p.add_argument("--guard-margin", type=float, default=None, metavar="NATS",
                   help="hand the answer to full prefill at a token whose two most likely choices are less than NATS "
                        "apart on the fused path (GenerationOptions.guard_margin; default: none)")
    p.add_argument("--guard-at", default=None, choices=["answer", "probe"],
                   help="where that guard reads its gap: the fused answer's tokens (answer, the default) or the "
                        "question probe of infoflow, prophetkv or qcfuse, before the fused prefill (probe)")
    _add_model_args(p)
    _add_gen_args(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (needs the serve extra)")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one, printed)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1/* "
                                                   "(default: $KVFUSE_API_KEY, else no key)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: the model's)")
    p.add_argument("--documents", default=None, help="JSON/JSONL documents to precompute and register at start")
    p.add_argument("--max-pending", type=int, default=64,
                   help="generation requests in flight at most; more are answered 429 (default 64)")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="answer length of requests that give no max_tokens (default 256)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are cancelled "
                        "(default 30)")
    p.add_argument("--no-disk-cache", action="store_true", help="keep document caches in memory only")
    p.add_argument("--memory-budget", default=None,
                   help="bytes of document caches kept in memory, e.g. 512M or 40G (default 4G on the CPU; on a GPU "
                        "see --gpu-memory-share)")
    p.add_argument("--gpu-memory-share", type=float, default=None, metavar="SHARE",
                   help=f"on a GPU, grow the document caches' pool until the card is this share of its memory in use "
                        f"(default {SERVE_GPU_SHARE} unless --memory-budget is given; 0: off, --memory-budget decides)")
    p.add_argument("--cold-documents", default=None, choices=["compute", "auto", "full"],
                   help="a request with documents that have no cache yet: compute them first (compute, the default), "
                        "or answer it by full prefill and build their caches between requests (full; auto: when "
                        "that is predicted faster)")
    p.add_argument("--guard-margin", type=float, default=None, metavar="NATS",
                   help="the guard of every request that sets none: a token of a fused answer whose two most likely "
                        "tokens are less than NATS apart hands the answer to full prefill from there (default: none; "
                        "a request's guard_margin 0 turns it off)")
    p.add_argument("--guard-tokens", type=int, default=None, metavar="N",
                   help="that guard checks only the answer's first N tokens (default: every token)")
    p.add_argument("--guard-at", default=None, choices=["answer", "probe"],
                   help="where that guard reads its gap: the fused answer's tokens (answer, the default) or, before "
                        "the fused prefill, the question probe of a query-aware strategy (probe: a hand-over then "
                        "skips the fused prefill; not with --guard-tokens)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--front", default=None, help="a measured front (kvfuse front) for strategy 'auto', instead of "
                                                "the one shipped for the model")
    p.add_argument("--warmup", default=None, metavar="LO:HI",
                   help="before serving, capture the CUDA graphs of every shape bucket of prompts of LO to HI tokens, "
                        "so that even a never-seen layout's first request replays one (e.g. 1024:8192; nothing to "
                        "do without CUDA graphs)")
    p.add_argument("--warmup-strategies", default=None,
                   help="comma-separated strategies to warm (default: the engine's default strategy)")
    p.add_argument("--warmup-questions", default=None, metavar="LO:HI",
                   help="question lengths to warm, in prompt-tail tokens (default 16:128)")
    p.add_argument("--warmup-ratios", default=None, help="comma-separated recompute ratios to warm (default 0.15)")
    p.add_argument("--idle-captures", action="store_true",
                   help="capture a shape bucket's CUDA graph in the engine's idle time instead of on the path of the "
                        "request that makes it due (that request then costs an eager run, not about twice one); for "
                        "a server that is the GPU's only user in its process (EngineConfig.idle_captures)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("route", help="one OpenAI-compatible front over several `kvfuse serve` replicas, routing each "
                                     "request to the replica most likely to hold its documents' caches")
    p.add_argument("--replica", action="append", required=True,
                   help="base URL of a replica (repeat for each), e.g. --replica http://10.0.0.5:8000")
    p.add_argument("--policy", default="affinity", choices=["affinity", "round_robin", "random"],
                   help="affinity: consistent hashing on document ids, load fallback (default); round_robin and "
                        "random ignore documents")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one, printed)")
    p.add_argument("--vnodes", type=int, default=160, help="hash-ring points per replica (default 160)")
    p.add_argument("--max-in-flight", type=int, default=32,
                   help="a replica with this many requests in flight is passed over while another has room "
                        "(default 32)")
    p.add_argument("--health-interval", type=float, default=2.0,
                   help="seconds between two /health polls of each replica (default 2)")
    p.add_argument("--seed", type=int, default=None, help="seed of the random policy")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get after SIGTERM (default 30)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_route)

    p = sub.add_parser("train-adapter", help="train a fusion adapter by self-distillation from full prefill "
                                             "(documents computed with it serve closer to full prefill)")
    _add_training_args(p, steps=200, lr=3e-4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down", help="projections adapted (comma separated)")
    p.add_argument("--max-doc-tokens", type=int, default=900, help="document tokens per training prompt at most")
    p.add_argument("--stage", default="offline", choices=["offline", "online"],
                   help="where the adapter acts: 'offline' (documents' caches; default) or 'online' (the rows a "
                        "fused prefill computes: recomputed rows and the question)")
    p.add_argument("--batch", type=int, default=1, help="prompts per optimiser step (default 1)")
    p.add_argument("--ratios", default="0,0.15", help="recompute ratios the student samples (default 0,0.15)")
    p.add_argument("--strategy", default="infoflow", help="the strategy whose selection the student recomputes")
    p.add_argument("--max-seconds", type=float, default=0.0,
                   help="stop (and save) after this much training time, resumed runs included; 0 (default) for no "
                        "limit")
    p.add_argument("--checkpoint-every", type=float, default=60.0, dest="checkpoint_every",
                   help="seconds between checkpoints (OUT.ckpt.safetensors; always written at the end; default 60)")
    p.add_argument("--holdout", type=int, default=0,
                   help="examples per dataset right after the reported split kept out of training and used to pick "
                        "the adapter written: the lowest held-out KL (with --eval-every; default 0, none)")
    p.add_argument("--eval-every", type=int, default=0, dest="eval_every",
                   help="steps between held-out measurements (with --holdout)")
    p.add_argument("--eval-prompts", type=int, default=16, dest="eval_prompts",
                   help="fixed held-out prompts measured each time (default 16)")
    p.add_argument("--first-token-weight", type=float, default=1.0, dest="first_token_weight", metavar="W",
                   help="weigh the answer's first position W times the others in the loss (most fused answers that "
                        "differ from full prefill's differ there first; default 1: the plain mean)")
    p.add_argument("--doc-context", default="none", choices=["none", "random"], dest="doc_context",
                   help="'random': the student's documents are computed after --context-docs passages of other "
                        "training examples, as a strategy's doc_context option serves them (train for "
                        "`infoflow:doc_context=pool`); 'none' (default): alone, as plain caches")
    p.add_argument("--context-docs", type=int, default=3, dest="context_docs",
                   help="passages before each document with --doc-context random (default 3, fusionrag's top_k)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run whose checkpoint is beside --out (same settings; a longer --max-seconds "
                        "or --steps lets it go on)")
    p.add_argument("--prompt", default="qa", help="prompt preset (as `kvfuse eval --prompt`; default qa)")
    p.add_argument("--out", required=True, help="the adapter file to write (.safetensors; a .json record beside it)")
    _add_model_args(p)
    p.set_defaults(func=cmd_train_adapter)

    p = sub.add_parser("train-links", help="train link rows by self-distillation from full prefill (a few "
                                            "learned rows after every cached document, computed per request)")
    _add_training_args(p, steps=300, lr=3e-3)
    p.add_argument("--k", type=int, default=8, help="link rows per document (default 8)")
    p.add_argument("--max-doc-tokens", type=int, default=900, help="document tokens per training prompt at most")
    p.add_argument("--ratios", default="0,0.15", help="recompute ratios the student samples (default 0,0.15)")
    p.add_argument("--strategy", default="infoflow", help="the strategy whose selection the student recomputes")
    p.add_argument("--holdout", type=int, default=0,
                   help="examples per dataset right after the reported split kept out of training and used to pick "
                        "the rows written: the lowest held-out KL (with --eval-every)")
    p.add_argument("--eval-every", type=int, default=0, dest="eval_every")
    p.add_argument("--eval-prompts", type=int, default=24, dest="eval_prompts")
    p.add_argument("--prompt", default="qa", help="prompt preset (as `kvfuse eval --prompt`; default qa)")
    p.add_argument("--out", required=True, help="the file to write (.safetensors; a .json record beside it)")
    _add_model_args(p)
    p.set_defaults(func=cmd_train_links)

    p = sub.add_parser("front", help="build the measured quality/TTFT front strategy='auto' reads, from a kvfuse "
                                      "eval summary and TTFT sources")
    p.add_argument("--quality", required=True, help="a kvfuse eval summary.csv (or summary.md): fidelity and KL")
    p.add_argument("--rel", action="append", default=[], metavar="DEVICE=SOURCE",
                   help="relative TTFT for a device type (cpu, cuda): an eval summary measured there, or a "
                        "benchmarks/ttft.py CSV as FILE.csv:SHAPE:CONTEXT (its first-sight rows); repeatable, also for one "
                        "device (a point takes its figure from the first source that measured it)")
    p.add_argument("--model", required=True, help="the registry model name the front describes")
    p.add_argument("--adapter", default="none", help="the adapter it was measured with: none, packaged, a "
                                                     ".safetensors file or a 16-hex digest prefix")
    p.add_argument("--datasets", default="", help="comma list of datasets to average over (default: all)")
    p.add_argument("--guarded", action="append", default=None,
                   help="a kvfuse eval summary whose first-token-guarded runs ('+guard<M>/1', from eval --guard M "
                        "--guard-tokens 1) and probe-guarded runs ('+probeguard<M>', from eval --guard M --guard-at "
                        "probe) become points of their own; repeatable (default: those of --quality)")
    p.add_argument("--probe-share", action="append", dest="probe_share", metavar="DEVICE=SHARE",
                   help="the question probe's share of a probing strategy's TTFT on DEVICE, for the TTFT of points "
                        "guarded at the probe ('+probeguard<M>', from eval --guard M --guard-at probe); repeatable; "
                        "default 1 (an upper bound: a hand-over then costs what one after the fused prefill does)")
    p.add_argument("--default", default="infoflow@0.15", help="the point auto takes with no target (STRATEGY@RATIO)")
    p.add_argument("--out", required=True, help="the front's JSON file")
    p.set_defaults(func=cmd_front)

    try:
        from kvfuse.evaluation.cli import add_eval_parser, run_eval
    except ImportError:
        pass
    else:
        add_eval_parser(sub)
        sub.choices["eval"].set_defaults(func=run_eval)

    from kvfuse.profile_cli import add_profile_parser

    add_profile_parser(sub)
    return parser


class _Stderr(logging.Handler):
    """Prints kvfuse's warnings (a disk cache that degraded, ...) as one line each on the current stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        msg = " ".join(record.getMessage().split("\n"))
        print(msg if msg.startswith("kvfuse:") else f"kvfuse: warning: {msg}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logger, handler = logging.getLogger("kvfuse"), _Stderr(logging.WARNING)
    logger.addHandler(handler)
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError, OSError, KeyError, RuntimeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        msg = " ".join(str(msg).split("\n"))  # one line, whatever the message holds
        print(f"kvfuse: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvfuse: interrupted", file=sys.stderr)
        return 130
    finally:
        logger.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
