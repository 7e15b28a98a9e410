"""Typed configuration, validated once at load (TOML file, then the environment's
``MOONCAKE_<SECTION>_<KEY>`` variables over it -> pydantic models).

Values discovered at run time (number of KV blocks, eos ids, ...) live in the
objects that discover them, never written back here.
"""

from __future__ import annotations

import difflib
import logging
import os
import tomllib
from pathlib import Path
from typing import Literal, Mapping
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator, model_validator

from mooncake.config_classes import RENAMED_KEYS, ClassesConfig
from mooncake.config_conductor import AdmissionConfig, ConductorConfig, LivenessConfig, ReplicationConfig
from mooncake.config_observability import ObservabilityConfig
from mooncake.config_section import Section, split_list

log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20


class ModelConfig(Section):
    path: str = Field("", description="Local HF model directory, GGUF file, or Hugging Face repo id (org/name) found in the local Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub; never downloaded); empty: the bundled SmolLM2-135M-Instruct.")
    name: str = Field("", description="Model name served in the API (--served-model-name); empty: the repo id (org/name) for a model from the Hugging Face cache, else the file or directory name.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bfloat16 on CUDA and on CPUs with AMX or AVX-512 BF16, float32 elsewhere (--dtype). float32 is token-exact against transformers; bfloat16 is close.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu.")
    block_hash: Literal["sha256", "xxh3_128"] = Field(
        "sha256", description="Chained hash keying KV blocks: sha256, or xxh3_128 (faster; part of the model id, so stores never mix schemes).")
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto", description="int8: weight-only int8 with a scale per output row (CPU, bfloat16; float32 runs too, slower): decode at small batch reads half the bytes. int4: weight-only int4 in groups of 32 with a scale and an offset each (the layout of GGUF's Q4_1: a Q4_1 file's own values come back exactly, as do a Q4_0 file's symmetric groups), 3/8 the bytes (with its float32 scales), for the projections whose weights already sit on such groups; the others int8. In either, the weights a GGUF stores in Q8_0 (int8 with a float16 scale per group of 32; the bundled model's tied lm_head) are served as the file stores them, never rounded again (a mostly-Q8_0 file's model id says so: +q8_0). auto: where the weights come from a GGUF stored quantized, serve in bfloat16 on a CPU, and the engine's kernels can run there (AVX-512 VNNI): int4 for a Q4_1 or Q4_0 file, int8 for any other (Q8_0, Q4_K_M, ...: int8 rows lose far less than the file's own rounding); none elsewhere. It is part of the model id: KV stored under the other choice is not reused.")
    kv_codec: Literal["none", "int8", "fp8"] = Field(
        "none", description="How KV blocks travel and are stored outside an engine's pool: none (the serving dtype's bytes), int8 (a float16 scale per channel of each layer's K and V of each head over the block's positions: 0.56x the bytes of bfloat16, 0.28x of float32) or fp8 (e4m3, same size, less accurate). Decoded where they land in a pool; part of the model id, so blocks of different codecs never mix. Exactness against transformers holds with none (BENCHMARKS.md section 23: the accuracy of each).")
    cache_dir: str = Field("~/.cache/mooncake", description="Where converted weights (from GGUF, in the serving dtype) are kept.")
    p2p_name: str = Field("", description="P2P object (mooncake p2p put NAME DIR) holding the model directory: a prefill/decode role whose model path is missing fetches it from peers, through its node's store, into path before loading.")
    p2p_store_wait_s: float = Field(120.0, gt=0, description="With p2p_name: how long a role waits for its node's store to register (the node's roles start in any order; a store recovering a large LMDB tier takes longer) before it gives up fetching the model.")


class EngineConfig(Section):
    block_tokens: int = Field(16, ge=1, le=4096, description="Token positions per KV block.")
    kv_cache_bytes: int = Field(1 * GiB, ge=1 * MiB, description="Bytes of the preallocated paged KV pool.")
    max_batch: int = Field(32, ge=1, le=1024, description="Most sequences in one decode step.")
    prefill_chunk_tokens: int = Field(512, ge=16, description="Tokens computed per prefill chunk (per forward: the chunks of several prompts share it).")
    step_tokens: int = Field(0, ge=0, description="A colocated instance's fixed tokens per step while it decodes: one per decoding sequence, the rest for prompt chunks. 0 (the default): no fixed count; each step carries the prompt tokens that keep it within the tightest TBT target of the classes it decodes (their tbt_slo_ms, else 200 ms, or what the start-up profile says this machine can keep), by the fitted cost of the instance's own steps.")
    max_prefill_batch: int = Field(8, ge=1, le=256, description="Prompts a prefill instance computes at once: their chunks go in one forward, so a burst of short prompts is not serialized (1: one prompt at a time).")
    max_model_len: int = Field(0, ge=0, description="Context limit in tokens, prompt and output (--max-model-len); 0: the model's own (max_position_embeddings); larger than the model's own: the model's own.")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0: torch's default.")
    native_kernels: bool = Field(True, description="The engine's own C kernels, built when the package is installed (else with the system C compiler on first use), used where the CPU has AVX-512 VNNI: int8 and int4 decode at small batch (quantization = \"int8\" or \"int4\", or \"auto\" where it picks one), and for Llama-style models every decode step's attention (with rotary and KV write), RMSNorm + residual add and SiLU gate; off, or where they cannot be built: torch's ops.")
    int4_activations: Literal["int8", "float"] = Field("float", description="How int4 weights (quantization = \"int4\", or \"auto\" on a Q4_1 or Q4_0 GGUF) meet the activations at small batch in the engine's kernels: float (each group unpacked to float32 and summed in float32: the float reference's results to float32 accuracy) or int8 (experimental: the activations rounded to int8 per block of 32 with a scale each and multiplied with the weights' nibbles by integer dot products, AVX-512 VNNI, as llama.cpp does; a projection's outputs within 1% (relative norm) of the float reference's, each row the same in any batch; 1.4-2.5x faster per projection, not yet faster per decode step on the bundled model).")
    speculative: Literal["off", "ngram"] = Field("off", description="Speculative decoding on decode and colocated instances: ngram (prompt lookup: the tokens that followed the latest earlier occurrence of the output's last few tokens, in the prompt or the output, are verified in the decode step's one forward; each step outputs every draft the model would have chosen, and one more) or off. Output is identical to decoding without it (greedy and seeded alike). Only decode batches whose sequences and drafts fit in 7 rows (one forward on the engine's int8/int4 kernels) speculate, and only where each row's result cannot depend on the row count (the engine's decode kernels and quantized projections; elsewhere it stays off, with a warning). Per request: \"speculative\": false opts out.")
    num_speculative_tokens: int = Field(6, ge=1, le=16, description="Draft tokens a sequence feeds per decode step at most (speculative = \"ngram\"); each sequence drafts one more than its last step accepted, up to this, and the batch shares the rows of one forward.")
    speculative_ngram_min: int = Field(2, ge=1, le=16, description="The shortest suffix of a sequence that is looked up for drafts (speculative = \"ngram\").")
    speculative_ngram_max: int = Field(4, ge=1, le=16, description="The longest suffix looked up first (speculative = \"ngram\"); at least speculative_ngram_min.")
    prefix_caching: bool = Field(True, description="Reuse cached KV of a prompt's prefix (off: every prompt is computed in full; a baseline).")
    profile_at_start: bool = Field(True, description="Time a few prefill sizes / decode batches at start-up and register them: the conductor's cost models start from this machine's numbers.")
    kv_load: Literal["layer", "block"] = Field("layer", description="How a prefill loads a cached prefix from a store: layer (the store streams it layer by layer and the forward of the new tokens starts at once, each layer waiting only for its own past KV; checksums verified over the streamed slices) or block (fetch every block whole, then compute). Pipeline stages always load block-wise.")
    kv_transfer: Literal["layer", "block"] = Field("block", description="How a prefill ships new KV to decode: block (a chunk's blocks leave after all its layers; concurrent requests' chunks are packed into one forward) or layer (each layer's KV of a chunk leaves as soon as that layer is computed, so little is in flight when prefill ends; chunks are then computed one sequence at a time).")

    @model_validator(mode="after")
    def _ngram_sizes(self) -> "EngineConfig":
        if self.speculative_ngram_max < self.speculative_ngram_min:
            raise ValueError(f"[engine] speculative_ngram_max ({self.speculative_ngram_max}) is below "
                             f"speculative_ngram_min ({self.speculative_ngram_min})")
        return self


class StoreConfig(Section):
    device_bytes: int = Field(0, ge=0, description="Device (GPU, else CPU tensor) tier capacity; 0: no device tier.")
    dram_bytes: int = Field(2 * GiB, ge=0, description="Host DRAM tier capacity (pinned when CUDA is present).")
    lmdb_bytes: int = Field(8 * GiB, ge=0, description="LMDB (SSD) tier capacity; 0: no disk tier.")
    data_dir: str = Field("./mooncake-data", description="Directory of the LMDB tier: one sub-dir per store (data_dir/<node id>, locked by its store), so stores may share it.")
    ssd_admission: Literal["on_demotion", "after_hits", "write_through"] = Field(
        "on_demotion", description="on_demotion: every block demoted from DRAM is written; after_hits: only blocks hit >= ssd_admission_hits times; write_through: every stored block is also written to LMDB as it arrives (batched, off the request path), so a crash loses at most the last batch. On SIGTERM a store writes its DRAM blocks to LMDB whatever this says.")
    ssd_admission_hits: int = Field(1, ge=1, description="Hits a block needs before it is admitted to SSD (after_hits).")
    promote_on_hit: bool = Field(True, description="A hit in a lower tier copies the block up to the top tier.")
    p2p_chunk_bytes: int = Field(16 * MiB, ge=64 * 1024, le=256 * MiB, description="Chunk size of the P2P objects this store publishes (each chunk checksummed, fetched from any holder).")
    p2p_in_flight_per_peer: int = Field(2, ge=1, le=64, description="P2P chunk requests a fetch keeps in flight to one holder, twice this to a holder that delivers 100 MB/s or more (there more requests let it read ahead; to a slow holder they would commit chunks another fetcher could soon serve: BENCHMARKS.md section 18).")
    p2p_stall_timeout_s: float = Field(30.0, gt=0, description="A P2P fetch that makes no progress this long (no live holder has what is missing) fails.")


class FrontendConfig(Section):
    """The OpenAI API: any number of frontends serve it side by side (``mooncake serve --role frontend``)."""

    host: str = Field("127.0.0.1", description="HTTP bind address.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port; 0: any free port.")
    api_key: str = Field("", description="If set, /v1/*, /cluster and /metrics need 'Authorization: Bearer <key>' (this key or one of api_keys); /health* stay open.")
    api_keys: list[str] = Field(default_factory=list, description="More accepted API keys (e.g. one per tenant, or the Prometheus scraper's), beside api_key.")
    salt_per_api_key: Literal["auto"] | bool = Field("auto", description="Derive the KV cache salt from the caller's API key (combined with any request cache_salt), so tenants with different keys never share or probe each other's blocks (usage.cached_tokens would tell one tenant what another sent). auto: on when more than one key is accepted; false shares the cache across keys.")
    token_port: int = Field(0, ge=0, le=65535, description="Port (on [node] host) where decode instances stream this frontend's tokens; 0: any free port.")
    max_body_bytes: int = Field(4 * MiB, ge=1024, description="Largest accepted HTTP body.")
    sse_keepalive_s: float = Field(10.0, gt=0, description="A stream with nothing to send for this long gets an SSE comment (keeps proxies with idle timeouts from cutting it while the request is queued).")
    sse_write_timeout_s: float = Field(30.0, gt=0, description="A stream the client takes nothing of for this long (it stopped reading; the server's buffer is full) ends: its request is cancelled and its KV freed.")
    access_log: bool = Field(False, description="Log one line per HTTP request (method, path, status, seconds, X-Request-Id).")
    place_timeout_s: float = Field(10.0, gt=0, description="How long a frontend waits for the conductor to place a request (its answer to the Submit) before refusing it with a 503; under [coordination] a failover's lease_ttl_s and two poll_s are added.")
    grammar_timeout_s: float = Field(5.0, gt=0, description="How long one request's JSON schema (response_format, tools) may take to compile once it has a grammar thread; past it the request gets a 400 (invalid_schema).")
    grammar_queue_s: float = Field(30.0, gt=0, description="How long a request with a JSON schema waits for a free grammar thread (others' schemas hold them all) before a 503 with a Retry-After.")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, v: object) -> object:
        """MOONCAKE_FRONTEND_API_KEYS (a string): comma-separated keys, or a JSON list."""
        return split_list(v, "api_keys")

    def accepted_keys(self) -> list[str]:
        """Every API key the HTTP server accepts (none: the API is open)."""
        return [k for k in (self.api_key, *self.api_keys) if k]

    def salts_per_key(self) -> bool:
        """Whether each key gets its own cache salt: as set, or (auto) when several keys are accepted."""
        if self.salt_per_api_key != "auto":
            return bool(self.salt_per_api_key)
        return len(set(self.accepted_keys())) > 1


class CoordinationConfig(Section):
    etcd_endpoints: list[str] = Field(default_factory=list, description="etcd client URLs (http://host:2379, as etcd prints them); set: conductors campaign for the lead through etcd, one leads and the others stand by, and frontends and workers follow the leader. Empty: one conductor, at [conductor] endpoint.")
    lease_ttl_s: int = Field(5, ge=2, le=300, description="The leader's etcd lease: a conductor that cannot refresh it this long steps down, and a standby leads once it lapses.")
    prefix: str = Field("/mooncake/default", description="etcd key prefix of this cluster (clusters sharing an etcd differ by it).")
    poll_s: float = Field(0.5, gt=0, description="How often frontends and workers ask etcd who leads.")
    regain_s: float = Field(30.0, gt=0, description="A leading conductor whose lease etcd can no longer prove (etcd restarted, or out of reach) stops acting at once and waits this long for etcd to prove it again before it gives up the lead and exits (its supervisor restarts it as a standby).")

    @field_validator("etcd_endpoints", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        """MOONCAKE_COORDINATION_ETCD_ENDPOINTS (a string): comma-separated URLs, or a JSON list."""
        return split_list(v, "etcd_endpoints")

    @field_validator("etcd_endpoints")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        """Each an http:// or https:// URL with a host (a typo such as http//host:2379 would make
        every etcd call fail, and is refused here instead)."""
        for url in v:
            try:
                parts = urlsplit(url)
                usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
            except ValueError:  # a port that is not a number in range
                usable = False
            if not usable:
                raise ValueError(f"etcd_endpoints: {url!r} is not an http:// or https:// URL with a host "
                                 "(e.g. http://127.0.0.1:2379)")
        return v


class NodeConfig(Section):
    name: str = Field("node0", description="Node (machine) name; roles with the same name are local to each other.")
    host: str = Field("127.0.0.1", description="Address this node's roles bind and advertise.")
    kv_port: int = Field(0, ge=0, le=65535, description="Decode KV ingress port; 0: any free port.")
    store_port: int = Field(0, ge=0, le=65535, description="Store object-API port; 0: any free port.")
    p2p_port: int = Field(0, ge=0, le=65535, description="Store P2P object port (chunk requests between peers, mooncake p2p; under CURVE the chunk bytes too); 0: any free port.")
    p2p_bulk_port: int = Field(0, ge=0, le=65535, description="Store P2P bulk port: without CURVE, chunk bytes go on this second TCP port (sendfile; never under CURVE); 0: any free port. A firewall between nodes must open it as well as p2p_port: where it cannot be reached, fetches from that store fall back to p2p_port (ZeroMQ), slower.")
    p2p_root: str = Field("", description="The only directory tree a store publishes from and fetches into (mooncake p2p put/get, [model] p2p_name: a worker's model path must lie under it); anything else is refused. Empty: <[store] data_dir>/p2p-objects.")
    p2p_key_file: str = Field("", description="Where the node's P2P key lies: random bytes its store writes at start (mode 0600) that its CLI and workers present to make it publish or fetch, so that no one off the node can. Roles of the node must all read it (workers in other containers: a shared directory). Empty: <[store] data_dir>/p2p-<node name>.key.")
    node_id: str = Field("", description="Unique id of this role process; empty: <name>-<role>-<pid>.")
    health_port: int = Field(0, ge=0, le=65535, description="Worker/store HTTP port for /health/live and /health/ready; 0: off.")
    prefill_nice: int = Field(10, ge=0, le=19, description="Nice value (OS scheduling priority, 0-19: higher yields more) of prefill role processes, so that where prefill and decode share a machine's cores (mooncake serve on one machine; any node running both) a decode step runs before a prefill chunk instead of waiting behind it; prefill gets the cores decode leaves (BENCHMARKS.md section 11). Set on every thread and, when the role leads its own session, on its autogroup (Linux). Alone on its cores a prefill loses nothing to it; 0: prefill at the same priority as decode. Negative values need privileges and are refused: lower a prefill's priority, not raise a decode's.")


class SecurityConfig(Section):
    curve_keys_dir: str = Field("", description="Directory with the role keys (mooncake keys DIR); set: role links use ZeroMQ CURVE, authenticated, encrypted and authorized per role kind.")
    allow_insecure_network: bool = Field(False, description="Let roles bind or connect to non-loopback addresses without CURVE keys (only on a network you trust).")
    max_message_bytes: int = Field(0, ge=0, description="Largest frame any role socket accepts (larger: the peer is disconnected); 0: 4 x the model's KV block bytes, at least 16 MiB (64 MiB for the conductor and stores).")
    max_pending_writes: int = Field(16, ge=1, description="Write-backs of KV to a store a worker keeps in flight; more are dropped (counted, logged).")


class Config(Section):
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    store: StoreConfig = StoreConfig()
    conductor: ConductorConfig = ConductorConfig()
    admission: AdmissionConfig = AdmissionConfig()
    liveness: LivenessConfig = LivenessConfig()
    replication: ReplicationConfig = ReplicationConfig()
    frontend: FrontendConfig = FrontendConfig()
    coordination: CoordinationConfig = CoordinationConfig()
    classes: ClassesConfig = ClassesConfig()
    node: NodeConfig = NodeConfig()

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, raw: object) -> object:
        """Keys that moved from [conductor] to another section (``MOVED_FROM_CONDUCTOR``) still work
        from [conductor] (and as MOONCAKE_CONDUCTOR_<KEY>), with a warning (the new section wins
        where both set one)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("conductor"), dict):
            return raw
        conductor = dict(raw["conductor"])
        moved = {k: conductor.pop(k) for k in list(conductor) if k in MOVED_FROM_CONDUCTOR}
        if not moved:
            return raw
        out = {**raw, "conductor": conductor}
        for key, value in moved.items():
            section = MOVED_FROM_CONDUCTOR[key]
            log.warning("[conductor] %s moved to [%s]: read from [conductor] this time; set it in [%s] (%s)",
                        key, section, section, env_name(section, key))
            table = out.get(section) if isinstance(out.get(section), dict) else {}
            out[section] = {key: value, **table}
        return out
    security: SecurityConfig = SecurityConfig()
    observability: ObservabilityConfig = ObservabilityConfig()


MOVED_TO_FRONTEND = ("host", "port", "api_key", "api_keys", "salt_per_api_key", "max_body_bytes",
                     "sse_keepalive_s", "access_log")
# [conductor] keys now in another section -> that section (the old place still works, warned)
MOVED_FROM_CONDUCTOR = {**dict.fromkeys(MOVED_TO_FRONTEND, "frontend"),
                        **{k: s for s, c in (("admission", AdmissionConfig), ("liveness", LivenessConfig),
                                             ("replication", ReplicationConfig)) for k in c.model_fields}}


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the key."""


ENV_PREFIX = "MOONCAKE_"


def env_name(section: str, key: str) -> str:
    """The environment variable that sets ``[section] key``: MOONCAKE_NODE_HOST for node.host."""
    return f"{ENV_PREFIX}{section.upper()}_{key.upper()}"


FAULT_PREFIX = ENV_PREFIX + "FAULT_"
# MOONCAKE_ variables that are not config keys: read elsewhere (logs.py), or fault injection.
OTHER_ENV_VARS = frozenset({ENV_PREFIX + "LOG_FORMAT"})


def _closest(var: str, names: list[str]) -> str | None:
    """The name ``var`` most likely misspells: one it extends or shortens, else a close match."""
    overlapping = [n for n in names if var.startswith(n) or n.startswith(var)]
    if overlapping:
        return max(overlapping, key=len)
    close = difflib.get_close_matches(var, names, n=1, cutoff=0.8)
    return close[0] if close else None


def _config_keys() -> dict[str, tuple[str, ...]]:
    """Every key's environment variable -> its path: (section, key), or (section, table, key) for a
    key of a section's table ([classes.flex] ttft_slo_ms: MOONCAKE_CLASSES_FLEX_TTFT_SLO_MS)."""
    known: dict[str, tuple[str, ...]] = {}
    for section, field in Config.model_fields.items():
        for key, sub in field.annotation.model_fields.items():  # type: ignore[union-attr]
            if isinstance(sub.annotation, type) and issubclass(sub.annotation, Section):
                known.update({env_name(section, f"{key}_{k}"): (section, key, k) for k in sub.annotation.model_fields})
            else:
                known[env_name(section, key)] = (section, key)
    known.update({env_name("conductor", key): ("conductor", key) for key in MOVED_FROM_CONDUCTOR})
    known.update({env_name(*old): old for old in RENAMED_KEYS})  # warned aliases
    return known


def env_overrides(env: Mapping[str, str]) -> tuple[dict, dict[tuple[str, ...], str]]:
    """``MOONCAKE_<SECTION>_<KEY>`` variables as {"section": {"key": "value"}}, and which
    variable set each key's path. An unknown MOONCAKE_ variable is a warning naming the
    closest key, not an error: other tools share the prefix (Mooncake's transfer engine reads
    MOONCAKE_PROTOCOL). ``MOONCAKE_FAULT_*`` is fault injection for tests, never configuration."""
    known = _config_keys()
    values: dict = {}
    origin: dict[tuple[str, ...], str] = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var.startswith(FAULT_PREFIX) or var in OTHER_ENV_VARS:
            continue
        if var not in known:
            close = _closest(var, [*known, *OTHER_ENV_VARS])
            hint = f"did you mean {close}?" if close else f"config keys are MOONCAKE_<SECTION>_<KEY>, e.g. {env_name('node', 'host')}"
            log.warning("ignoring unknown environment variable %s (%s)", var, hint)
            continue
        *tables, key = known[var]
        target = values
        for table in tables:
            target = target.setdefault(table, {})
        target[key] = env[var]
        origin[known[var]] = var
    return values, origin


def _merge(into: dict, layer: dict, where: str, path: str = "") -> None:
    """``layer``'s keys over ``into``'s, table by table."""
    for key, value in layer.items():
        if isinstance(value, dict):
            if not isinstance(into.setdefault(key, {}), dict):
                raise ConfigError(f"invalid config{where}: {path}{key} must be a [section]")
            _merge(into[key], value, where, f"{path}{key}.")
        else:
            into[key] = value


def _at(tree: dict, path: tuple[str, ...]) -> object:
    for key in path:
        tree = tree.get(key) if isinstance(tree, dict) else None  # type: ignore[assignment]
    return tree


def load_config(path: str | Path | None = None, overrides: dict | None = None,
                env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a TOML config (``path`` may be None: defaults), then the
    environment's MOONCAKE_<SECTION>_<KEY> variables over it (``env``; default os.environ),
    then ``overrides`` ({"section": {...}}) on top."""
    raw: dict = {}
    where = f" {path}" if path else ""
    if path is not None:
        p = Path(path)
        try:
            raw = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
    from_env, origin = env_overrides(os.environ if env is None else env)
    for layer in (from_env, overrides or {}):
        _merge(raw, layer, where)
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = tuple(str(x) for x in err["loc"])
            at = ".".join(loc)
            key = next((loc[:n] for n in (3, 2) if loc[:n] in origin), loc[:2])
            if key not in origin and len(key) == 2 and MOVED_FROM_CONDUCTOR.get(key[1]) == key[0] \
                    and ("conductor", key[1]) in origin:
                key = ("conductor", key[1])  # a moved key, set under its old name
            key = next((old for old, new in RENAMED_KEYS.items() if new == key and key not in origin and old in origin), key)
            if key in origin and _at(overrides or {}, key) is None:
                secret = RENAMED_KEYS.get(key, key) in SECRET_KEYS or ("frontend", key[-1]) in SECRET_KEYS
                at = f"{at} (from {origin[key]}={MASK if secret else repr(_at(from_env, key))})"
            problems.append(f"{at}: {err['msg']}")
        raise ConfigError(f"invalid config{where}: {'; '.join(problems)}") from None


SECRET_KEYS = {("frontend", "api_key"), ("frontend", "api_keys"), ("classes", "api_key_classes")}  # old names too
MASK = "***"
