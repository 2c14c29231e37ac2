"""Engine configuration: one frozen dataclass, validated at construction. Units are in the field names."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .prompt import PromptFormat
from .validate import check_dir_path, check_guard_at, check_int, check_real, check_redis_url

__all__ = ["COLD_DOCUMENTS", "EngineConfig", "resolve_device", "resolve_dtype"]

COLD_DOCUMENTS = ("compute", "auto", "full")  # EngineConfig.cold_documents

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`None`/"auto" -> cuda when available, else cpu. An unavailable cuda raises."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return d


def resolve_dtype(dtype: str | torch.dtype | None, device: str | torch.device | None = None) -> torch.dtype:
    """`None` -> bfloat16 on CUDA and on CPUs that multiply bf16 natively (AVX512-BF16, AMX, Arm BF16: 2-3x
    faster than fp32 there); float32 on other CPUs, where bf16 matmul is emulated and runs some 50-100x slower
    than fp32 (measured: 1.2 vs 84 GFLOP/s on an AVX2 EPYC). A dtype named explicitly is always taken."""
    if dtype is None:
        dev = torch.device(device) if device is not None else None
        if dev is None or dev.type != "cpu":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 flags; "bf16" is the aarch64 Features name


@functools.lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 at least about as fast as fp32: from /proc/cpuinfo's flags where Linux
    has them, else measured once (a 256x512x512 product in each dtype; bf16 counts as fast within 1.25x of
    fp32's time). Cached for the process."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    said = cpuinfo_says_bf16(text)
    return said if said is not None else _bf16_matmul_ratio() <= 1.25


def cpuinfo_says_bf16(cpuinfo: str) -> bool | None:
    """From /proc/cpuinfo's text: whether its first flags (x86) or Features (aarch64) line names native bf16;
    None when no such line is there."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() in ("flags", "features"):
            return bool(_BF16_FLAGS & set(value.split()))
    return None


def _bf16_matmul_ratio() -> float:
    """Time of a bf16 matmul over the same fp32 matmul on this CPU (best of three each)."""
    import time

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 512, generator=g)
    best = {}
    for dt in (torch.float32, torch.bfloat16):
        x, y = a.to(dt), b.to(dt)
        x @ y
        times = []
        for _ in range(3):
            t = time.perf_counter()
            x @ y
            times.append(time.perf_counter() - t)
        best[dt] = min(times)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one FusionEngine.

    Attributes:
        memory_budget_bytes: in-memory KV tier budget, bytes (the documents' rows of the GPU pool, or the host tier's
            tensors).
        document_pass_tokens: documents without a cache (a request's new documents, a precompute slice) are computed
            together, each after the prefix as if alone, in passes of at most this many rows (engine/docpass.py): one
            GEMM per weight for all of them instead of one prefill each (on CUDA with one padded attention call per
            layer). 0: one document per pass. Default 8192. Measured (`benchmarks/cold_documents.py`):
            on an H100, a cold infoflow request of new documents 4.7x faster at 2k and 7.3x at 8k on the 0.5B shape,
            1.85-2.5x at 2k and 2.1x at 8k on the 8B shape, than one prefill per document; on the CPU a hotpotqa
            example's 10 passages took about a full prefill's time in one pass against 1.1-1.7x one per pass
            (`--device cpu --real ../shared/data/hotpotqa.migres.jsonl`). On the CPU the pass runs its GEMMs in
            fixed-shape chunks (`document_chunk_rows`), so a document's cache is the same bits whichever documents
            shared its pass and cold and warm requests give bit-identical answers; on CUDA a cache computed beside
            others differs from the one computed alone by GEMM rounding (an ulp), which fixed-shape chunks would
            avoid at 1.2-2.7x the pass's time there (measured, same benchmark).
        document_chunk_rows: rows of every GEMM of a documents pass (engine/docpass.py `chunk`): the pass is padded
            and run through each weight this many rows at a time, one shape whatever the pass holds, so a
            document's cache is the same bits whichever documents shared its pass (also on CUDA: tested there). None
            (the default): 256 on the CPU (about level with one GEMM per weight there, `DOCUMENT_CHUNK_ROWS`), none
            on CUDA (512-row chunks made the pass 1.2-2.7x slower on an H100); 0: never.
        gpu_memory_share: with the pool tier on a GPU, size the documents' rows instead so that the whole device is
            this share of its memory in use once the pool is made (vLLM's gpu_memory_utilization): everything held
            when the engine is built (its weights, other processes) counts, and the rest beyond the pool stays free
            for prefills, CUDA graphs and other work. None (the default): `memory_budget_bytes` decides. On a CPU
            or the host tier it has no effect. `kvfuse serve` sets 0.8 unless told otherwise: a server owns its
            card, a library shares it.
        disk_cache_dir: folder of the persistent KV tier; None keeps caches in memory only.
        disk_budget_bytes: size limit of the disk tier, bytes.
        prompt: the prompt format (system prompt, instruction, question template).
        kv_tier: where hot document caches live: "pool" (one preallocated pool on the compute device, used in
            place by row; the GPU default), "host" (standalone tensors in host memory, pinned and streamed to a
            GPU layer by layer; the CPU default), or "auto".
        scratch_tokens: rows of the pool reserved for one request's recomputed tokens (0: the context window,
            capped at 32768).
        cuda_graphs: on CUDA, replay repeated prefill signatures and every decode step from CUDA graphs.
        piecewise_graphs: with cuda_graphs, also replay each layer's dense pieces of a never-seen layout from
            graphs per row bucket (engine/piecewise.py). Experimental, off by default: padded shapes change the
            GEMMs' rounding, so a first-sight request's tokens can differ from its repeated (whole-graph) replay.
        idle_captures: with cuda_graphs, a shape bucket due for capture (its second sighting) runs eagerly and is
            captured in the engine's idle time (between requests, by the scheduler) instead of on that request's
            path, where recording cost the request about as much again as running it (engine/bucketed.py). Off by
            default: only for a process in which this engine is the only CUDA user (a `kvfuse serve` replica). A
            capture in idle time overlaps whatever other threads run on the GPU, and PyTorch's graph capture is
            not safe against that: on an H100, other engines' work and graph teardown in the same process made
            captures fail (the buckets then run eagerly for good) and broke the other engines' own captures.
        bucketed_prefill: fused prefills of strategies whose choice is layout-free run padded to a shape bucket
            with the layout as data, so one CUDA graph per bucket serves every layout (engine/bucketed.py).
            None: on CUDA (graphed when `cuda_graphs`). True on the CPU runs the same padded path (tests).
        id_index_bytes: bound of the in-memory document-id -> content-key index (least recently used ids are
            forgotten beyond it; a forgotten id only loses its stale count).
        cache_secret: signs disk cache entries with HMAC-SHA256 and serves only entries signed with it, so a
            process that can write the cache folder but lacks the secret can't plant a well-formed entry of wrong
            numbers (checksums catch damage, not forgery). Default: $KVFUSE_CACHE_SECRET, or unsigned.
        disk_retry_s: after the disk tier fails (read-only, full, not a database), caches are kept in memory
            only for this many seconds before the folder is tried again.
        max_batch_size: requests decoding at once (one batched forward per decode step).
        prefill_tokens_per_step: between two decode steps the scheduler starts waiting requests until the prompt
            tokens they computed reach this (at least one request): higher fills batches faster, lower keeps the
            running requests' inter-token latency steadier.
        max_queued_requests: requests waiting for a batch slot; beyond it a request is refused with
            EngineOverloaded (a server answers 429).
        scheduler_cpu_threads: intra-op CPU threads of the scheduler thread (the one that serves requests), that
            thread alone. None: 1 when the model runs on an accelerator, where that thread's CPU tensor work is
            small host bookkeeping on the TTFT path and waking a pool of one thread per core costs more than the
            work (engine/threads.py has the figures); the process default when the model runs on the CPU.
        cold_documents: what a request that reads caches does when some of its documents have none yet (new
            documents: a RAG request's first sight of them). "compute" (default): each is prefilled alone and
            stored, then the request is fused as asked, so an answer does not depend on whether its documents were
            cached before (it pays those prefills before its first token). "full": the request is answered by full
            prefill (the exact answer, at full prefill's cost) and the missing caches are built when the engine is
            next idle, or computed at their next request if it comes first. "auto": "full" when computing the
            missing documents and then fusing is predicted to cost more than a full prefill (missing tokens /
            prompt tokens >= 1 - the strategy's TTFT relative to full, read from the model's measured front for
            this device; 0.5 when the front has no such point), "compute" otherwise. With either, a request's
            first sight of its documents gets full prefill's answer and later ones the fused answer. A result
            served by full prefill this way has strategy "full" and says why in `extra["cold"]`.
        guard_margin: the guard every request gets unless it sets its own (`GenerationOptions.guard_margin`; a
            request's 0 turns it off): nats, None for none (the default). A fused answer's token whose two most
            likely tokens are less than this apart hands the answer to full prefill from there.
        guard_tokens: how many of the answer's first tokens that guard checks, for requests that set none
            (`GenerationOptions.guard_tokens`); None: every token.
        guard_at: where the guard reads its gap, for requests that set none (`GenerationOptions.guard_at`):
            "answer" (the default) or "probe".
        decode_tokens: KV rows kept for running requests (their computed prompt rows and answers), beyond the
            documents' memory budget (0: twice the context window, capped at 2 x 32768). With the pool tier they are
            rows of the same pool (a document's rows are read in place, never copied; requests may also take rows
            of evicted documents); with the host tier, a decode arena of their own on the compute device.
        redis_url: a Redis server shared by several engines (machines) as a third cache tier behind memory and
            disk: redis://[:password@]host:port/db, rediss://... (TLS) or unix:///socket. None: no shared tier.
            Needs the `redis` extra. Entries are signed with `cache_secret` when set (recommended on a shared
            server).
        redis_budget_bytes: bytes of entries this model's namespace keeps in Redis; least recently used entries
            of the namespace are deleted beyond it.
        redis_timeout_s: connect and reply timeout of each Redis operation; a slower answer is a local miss.
        redis_retry_s: after a Redis failure (down, refusing, timing out), the tier is skipped for this many seconds
            before it is tried again.
        redis_ttl_s: Redis entries expire this long after their last use (0: never; the budget still bounds them).
    """

    memory_budget_bytes: int = 4 << 30
    gpu_memory_share: float | None = None
    document_pass_tokens: int = 8192
    document_chunk_rows: int | None = None
    disk_cache_dir: Path | None = None
    disk_budget_bytes: int = 20 << 30
    prompt: PromptFormat = field(default_factory=PromptFormat)
    kv_tier: str = "auto"
    scratch_tokens: int = 0
    cuda_graphs: bool = True
    piecewise_graphs: bool = False
    idle_captures: bool = False
    bucketed_prefill: bool | None = None
    id_index_bytes: int = 16 << 20
    disk_retry_s: float = 60.0
    cache_secret: str | bytes | None = None
    max_batch_size: int = 64
    max_queued_requests: int = 1024
    prefill_tokens_per_step: int = 4096
    decode_tokens: int = 0
    redis_url: str | None = None
    redis_budget_bytes: int = 8 << 30
    redis_timeout_s: float = 0.1
    redis_retry_s: float = 30.0
    redis_ttl_s: float = 7 * 86400.0
    scheduler_cpu_threads: int | None = None
    cold_documents: str = "compute"
    guard_margin: float | None = None
    guard_tokens: int | None = None
    guard_at: str = "answer"

    def cache_secret_bytes(self) -> bytes | None:
        """The disk cache's signing secret: `cache_secret`, else $KVFUSE_CACHE_SECRET, else None (unsigned)."""
        secret = self.cache_secret if self.cache_secret is not None else os.environ.get("KVFUSE_CACHE_SECRET")
        if not secret:
            return None
        return secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)

    def __post_init__(self) -> None:
        if self.bucketed_prefill not in (None, True, False):
            raise ValueError(f"bucketed_prefill must be None, True or False, got {self.bucketed_prefill!r}")
        if self.kv_tier not in ("auto", "pool", "host"):
            raise ValueError(f"kv_tier must be 'auto', 'pool' or 'host', got {self.kv_tier!r}")
        if self.memory_budget_bytes < 0 or self.disk_budget_bytes < 0 or self.id_index_bytes < 0:
            raise ValueError("cache budgets must be >= 0 bytes")
        if isinstance(self.document_pass_tokens, bool) or not isinstance(self.document_pass_tokens, int) \
                or self.document_pass_tokens < 0:
            raise ValueError(f"document_pass_tokens must be an int >= 0, got {self.document_pass_tokens!r}")
        if self.document_chunk_rows is not None and (
                isinstance(self.document_chunk_rows, bool) or not isinstance(self.document_chunk_rows, int)
                or self.document_chunk_rows < 0):
            raise ValueError(f"document_chunk_rows must be None or an int >= 0, got {self.document_chunk_rows!r}")
        if self.gpu_memory_share is not None and (isinstance(self.gpu_memory_share, bool)
                                                  or not isinstance(self.gpu_memory_share, (int, float))
                                                  or not 0.0 < self.gpu_memory_share <= 1.0):
            raise ValueError(f"gpu_memory_share must be None or a number in (0, 1], got {self.gpu_memory_share!r}")
        if (self.max_batch_size < 1 or self.max_queued_requests < 0 or self.decode_tokens < 0
                or self.prefill_tokens_per_step < 1):
            raise ValueError("max_batch_size and prefill_tokens_per_step must be >= 1, max_queued_requests and "
                             "decode_tokens >= 0")
        if self.scheduler_cpu_threads is not None and (isinstance(self.scheduler_cpu_threads, bool)
                                                       or not isinstance(self.scheduler_cpu_threads, int)
                                                       or self.scheduler_cpu_threads < 1):
            raise ValueError(f"scheduler_cpu_threads must be None or an int >= 1, got {self.scheduler_cpu_threads!r}")
        if self.cold_documents not in COLD_DOCUMENTS:
            raise ValueError(f"cold_documents must be one of {COLD_DOCUMENTS}, got {self.cold_documents!r}")
        if self.guard_margin is not None:
            check_real(self.guard_margin, "guard_margin", low=0.0)
        if self.guard_tokens is not None:
            check_int(self.guard_tokens, "guard_tokens", minimum=1)
        check_guard_at(self.guard_at, self.guard_tokens if self.guard_at == "probe" else None)
        if not self.disk_retry_s >= 0:
            raise ValueError(f"disk_retry_s must be >= 0 seconds, got {self.disk_retry_s}")
        if self.redis_url is not None:
            check_redis_url(self.redis_url, "redis_url")
        if self.redis_budget_bytes < 0:
            raise ValueError(f"redis_budget_bytes must be >= 0 bytes, got {self.redis_budget_bytes}")
        if not 0 < self.redis_timeout_s <= 60:
            raise ValueError(f"redis_timeout_s must be in (0, 60] seconds, got {self.redis_timeout_s}")
        if not self.redis_retry_s >= 0 or not self.redis_ttl_s >= 0:
            raise ValueError("redis_retry_s and redis_ttl_s must be >= 0 seconds")
        if self.disk_cache_dir is not None:
            object.__setattr__(self, "disk_cache_dir", check_dir_path(self.disk_cache_dir, "disk_cache_dir"))
