"""The engine's whole contract: the requests a caller submits, the typed result each one answers
with, and the typed error a failed one reports. Plain Python (no MLX): the app imports it.

    engine = Engine(EngineOptions(model="SmolLM2-135M-Instruct.Q4_1.gguf")).start()
    h = engine.submit(GenerateRequest(messages=[{"role": "user", "content": "Hi"}]))
    for event in h.events(): ...   # Token, Progress, Log, then Done(Generation) or Failed(message, code, reason)
    engine.call(Status()).model               # submit and wait: the result, or EngineError

| request            | result          | what it does                                                        |
|--------------------|-----------------|---------------------------------------------------------------------|
| LoadModel          | ModelLoaded     | load a GGUF (and a control vector); the old model serves until then  |
| GenerateRequest    | Generation      | a reply (streamed as Token events), K/V kept for the conversation   |
| SaveSession        | SessionSaved    | a conversation's tokens and K/V to a file                           |
| RestoreSession     | SessionRestored | a session file back as the live conversation                        |
| Configure          | EngineStatus    | K/V format, parking cap and slots, the disk tier's cap, the speed-projection default |
| ClearDiskCache     | EngineStatus    | every conversation in the disk tier removed                         |
| ForgetConversation | EngineStatus    | a deleted chat's K/V dropped (disk tier and parking)                |
| Status             | EngineStatus    | model facts (path, info, context, hash), conversations, memory      |
| CountTokens        | TokenCount      | how many tokens messages (or a prompt) make with the model's template |
| SessionSteering    | SessionSteeringInfo | the control vector a session file was saved with             |
| CaptureStates      | CapturedStates  | every block's output at prompts' last/first tokens (`cvec train`)   |

Errors: `Failed.code` / `EngineError.code` is an `ErrorCode` (bad_request, model_not_loaded,
session_refused with a `SessionRefusal` reason, memory_refused, cancelled, unavailable, internal).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import EngineError, ErrorCode, SessionRefusal  # noqa: F401 - re-exported: the error half
from engine.model.gguf_split import split_name
from engine.limits import DEFAULT_CACHE_MIB, DEFAULT_CACHE_SLOTS, SPEED_PROJECTION_DEFAULT, check_configure
from engine.sampling import SamplingParams


# ---- options -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineOptions:
    """How an engine starts (immutable): the values that change while it runs live where they are used
    (the parking cap and slots in Parking, the disk cap in DiskTier, the K/V width, the projection's default
    and the control-vector config in `Engine.in_force`)."""
    model: str | None = None                  # loaded at start; a failure is the start-up load's Failed
    context_length: int | None = None         # None: the model's own, capped at 8192
    cache_mib: int = DEFAULT_CACHE_MIB        # conversation parking cap (0 = off)
    cache_slots: int = DEFAULT_CACHE_SLOTS
    steering: Any = None                      # control_vector.SteeringConfig or None
    speed_projection: bool = SPEED_PROJECTION_DEFAULT   # the per-request switch's default when a vector is loaded
    prefill_chunk: int = 512
    dtype: str | None = None                  # None: float32 on the CPU, float16 on a GPU
    kv_bits: int = 16                         # K/V storage: 16, 8 or 4 bits (engine/cache/kv_format.py)
    # The disk tier under parking (engine/disk/disk_tier.py), MiB, 0 = off. Off for an engine built in code (a
    # bench, a test, an embedding: each starts cold unless it asks); the CLI, the server and the app pass
    # their default, limits.DEFAULT_DISK_MIB.
    disk_mib: int = 0
    disk_dir: str | None = None               # its folder (None: the data folder's cache/conversations)
    # generate requests decoded together in one batch (engine/generation/batching.py), at most this many
    # at once (the rest queue); 1 = one request at a time. 1 for an engine built in code; the CLI, the
    # server and the app pass their default, limits.DEFAULT_MAX_SEQUENCES.
    max_sequences: int = 1
    # A draft model (a GGUF with the model's vocabulary) loaded with the start-up model: `speculative:
    # draft:PATH` requests naming it use it (LoadModel.draft). The CLI sets it from --spec draft:PATH.
    draft: str | None = None
    # The image projector (an mmproj GGUF) loaded with the start-up model: None looks beside the model
    # for mmproj-*.gguf (engine/vision/find.py), "" loads none. The CLI sets it from --mmproj PATH.
    mmproj: str | None = None
    # The most tokens one image may take with that projector (a dynamic-size type's budget, within
    # llama.cpp's range for the type; a larger image is scaled down); 0: the type's default. The CLI
    # sets it from --image-max-tokens N.
    image_max_tokens: int = 0


# ---- requests ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ImageInput:
    """An image in a user message, as its encoded file (PNG, JPEG, WebP, GIF, ...): the engine decodes it
    (bounded) and keys the K/V by the decoded pixels. In a message, `content` is then a list of parts:
    {"type": "text", "text": str} and {"type": "image", "image": ImageInput}, in the order shown."""
    data: bytes
    name: str = ""                            # the file's name, for messages and logs


@dataclass
class GenerateRequest:
    messages: list[dict] | None = None        # chat: rendered with the model's template
    prompt: str | None = None                 # raw text: fed as is (BOS as the GGUF says)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speed_projection: bool | None = None      # None: the engine's default
    conversation: str = ""                    # a label for logs; also the K/V's owner (a new branch of
                                              # the same conversation, e.g. Regenerate, reuses its slot)
    side: bool = False                        # a side request (titles, counts): never parks, takes or
                                              # evicts a conversation's K/V; projection off unless asked
    speculative: str = "off"                  # "off" | "lookup" | "draft:PATH" (engine/generation/speculative.py)
    constraint: Any = None                    # constraints.ConstraintSpec: the reply must match it
                                              # (response_format json_object/json_schema, forced tool calls)
    tools: list[dict] | None = None           # the chat template's `tools` (OpenAI function tools;
                                              # engine/frontends/tool_calls.py prepares them and the messages)
    # A history longer than the context (engine/text/context_policy.py): "stop" refuses a prompt over it
    # and stops the reply at its end; "truncate_middle" / "rolling" leave out earlier turns
    # (Generation.dropped_messages says how many) so the prompt and the reply's reserve fit.
    overflow: str = "stop"
    context_limit: int = 0                    # a context smaller than the model's (a chat's config); 0: the model's


@dataclass
class LoadModel:
    path: str
    steering: Any = "keep"                    # "keep" the current SteeringConfig, or a new one / None
    draft: str | None = None                  # a draft GGUF loaded with it, as one unit (a draft that cannot
                                              # load refuses the load); None: none (a request may name one)
    mmproj: str | None = None                 # its image projector: a path (one that cannot serve the model
                                              # refuses the load); None: an mmproj-*.gguf found beside it
                                              # (one that cannot serve it is skipped, said in the log); "": none
    image_max_tokens: int = 0                 # the most tokens an image takes with it (0: the projector type's
                                              # default; outside the type's range the load is refused)


@dataclass
class SaveSession:
    path: str
    messages: list[dict] | None = None        # which conversation (live or parked); None: the live one
    force: bool = False                       # replace a file holding a longer conversation (else refused:
                                              # code session_refused, reason overwrite: ask, then resend)
    sync: bool = True                         # fsync before the rename (False: benchmarks only)
    # The steering applied to that conversation's K/V (its identity): None takes whichever held K/V
    # has these messages. When none is held, the conversation is read again with this setting
    # (None: the engine's default) and then saved.
    speed_projection: bool | None = None
    conversation: str = ""                    # its id: the held K/V is found by it (its messages confirming
                                              # the turn), and K/V read again gets it as its owner


@dataclass
class RestoreSession:
    path: str
    # None: restore with the file's own steering when this engine can apply it (the result's
    # speed_projection says which); True/False: refuse a file saved with another setting.
    speed_projection: bool | None = None
    conversation: str = ""                    # the owner of the restored K/V


@dataclass
class Configure:
    kv_bits: int | None = None                # K/V format of conversations from now on
    cache_mib: int | None = None
    cache_slots: int | None = None
    speed_projection: bool | None = None      # the default of requests that name none
    disk_mib: int | None = None               # the disk tier's cap (0 = off: nothing more is written)

    def __post_init__(self):
        # The bounds, once, for every caller (engine/limits.py): a request out of range is never built.
        for name, value in check_configure(self.kv_bits, self.cache_mib, self.cache_slots, self.disk_mib).items():
            setattr(self, name, value)


@dataclass
class Status:
    pass


@dataclass
class ClearDiskCache:
    """Every conversation in the disk tier removed (the settings page's Clear) -> EngineStatus."""


@dataclass
class ForgetConversation:
    """A deleted chat: its conversation's K/V dropped from the disk tier and from parking -> EngineStatus."""
    conversation: str


@dataclass
class CountTokens:
    """The prompt's length in tokens as a GenerateRequest with these messages (or prompt) would make it."""
    messages: list[dict] | None = None
    prompt: str | None = None
    tools: list[dict] | None = None           # as GenerateRequest.tools


@dataclass
class SessionSteering:
    """The steering a session file names (read from its header; nothing is restored)."""
    path: str


@dataclass
class CaptureStates:
    """Run each prompt (one user message, generation prompt appended) through the model with every
    block's output captured at the last and first positions; the speed projection is off meanwhile.
    Progress("capture", done, total) after each prompt."""
    prompts: list[str]


# ---- results -------------------------------------------------------------------------------------
class Result:
    """Base of the typed results: callers read fields (`r.text`, `r.tokens`); `to_dict()` is the JSON
    form. There is no `r["key"]`: a key read fails loudly (TypeError)."""

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: dict, **extra):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in {**d, **extra}.items() if k in names})


@dataclass
class Generation(Result):
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0                    # prompt tokens taken from held K/V
    generated_tokens: int = 0
    ttft_ms: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    finish_reason: str = "length"             # "stop" | "length" | "cancelled"
    speed_projection: bool = False            # whether the control vector was applied
    speculative: str = "off"                  # speculative decoding (engine/generation/speculative.py) and its counts
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    speculation_stopped: str | None = None
    restored_from_disk: int = 0               # of cached_tokens, how many the disk tier restored
    dropped_messages: int = 0                 # left out of the prompt by the overflow policy


@dataclass
class ModelFacts(Result):
    """What is loaded, as one immutable value (Status's `facts`; Engine.facts() between requests)."""
    model_path: str
    model_id: str                             # the file's stem: the server's model id
    name: str                                 # general.name ("" when the file has none)
    info: dict                                # models.ModelInfo as a dict
    n_ctx: int
    model_hash: str
    distributed: dict | None = None
    think_open: bool = False                  # the chat template opens a <think> block for the reply (Qwen3.5)
    vision: str | None = None                 # the image projector's type (an mmproj loaded with the
                                              # model, e.g. "gemma3"); None: the model reads text only


@dataclass
class EngineStatus(Result):
    model: str | None = None                  # the loaded model's path (None: none loaded)
    facts: ModelFacts | None = None
    info: dict | None = None
    context_length: int = 0
    live_tokens: int = 0
    live_messages: list[dict] = field(default_factory=list)   # the live conversation's messages
    conversations: list[dict] = field(default_factory=list)   # held K/V, live first: owner, tokens, live
    parking: dict | None = None               # parking.Parking.status(): entries, bytes, cap, slots
    memory: dict | None = None                # total_bytes, available_bytes, source
    memory_unavailable: str | None = None
    load_budget: dict | None = None           # bytes, source: what a model may take
    cache_mib_max: int = 0
    steering: str | None = None               # the loaded control vector, described
    steering_error: str | None = None         # why the configured one was refused
    speed_projection_default: bool = SPEED_PROJECTION_DEFAULT
    kv_bits: int = 16
    distributed: dict | None = None
    disk: dict | None = None                  # disk_tier.DiskTier.status(): entries, bytes, cap_bytes, folder
    batch: BatchCounters | None = None        # continuous batching's counters (None: no batch yet)
    vision: dict | None = None                # the image projector (vision.spans.VisionStats): projector, path,
                                              # tokens_per_image, images_encoded, feature_cache_entries/_bytes,
                                              # images_prepared


@dataclass
class ModelLoaded(Result):
    model: str
    info: dict
    steering_error: str | None = None         # the control vector refused (the model serves without it)
    facts: ModelFacts | None = None
    draft: str | None = None                  # the draft model loaded with it (its path)


@dataclass
class SessionSaved(Result):
    path: str = ""
    session_bytes: int = 0
    save_ms: float = 0.0
    sync_ms: float = 0.0
    tokens: int = 0
    synced: bool = False
    profile: dict = field(default_factory=dict)
    reread: bool = False                      # the K/V was not held: the conversation was read again
    speed_projection: bool = False            # the steering of the saved K/V


@dataclass
class SessionRestored(Result):
    restored_tokens: int = 0
    restore_ms: float = 0.0
    messages: list[dict] = field(default_factory=list)
    session_bytes: int = 0
    profile: dict = field(default_factory=dict)
    speed_projection: bool = False            # the restored conversation's steering
    steering: dict | None = None              # fingerprint and the vector the file names


@dataclass
class TokenCount(Result):
    tokens: int
    system_tokens: int = 0                    # of `tokens`, the leading system messages' part (the rest is
                                              # the conversation and the template's generation prompt)
    ids: list[int] = field(default_factory=list)    # the prompt's token ids, as a generate request feeds them


@dataclass
class BatchCounters(Result):
    """What continuous batching did since the engine started (EngineStatus.batch): batched steps, steps with
    several rows, the most rows in one step, rows served, rows whose prompts were read together."""
    steps: int = 0
    shared_steps: int = 0
    peak_rows: int = 0
    rows: int = 0
    read_together: int = 0      # rows whose prompt was read in a group (engine/generation/batch_prefill.py)
    first_from_prompt: int = 0  # rows joining running rows, their first token from their prompt's pass
    image_rows: int = 0         # rows whose prompt's image runs were fed into their own cache before joining
    # where a decode step's time goes on the engine thread (bench/concurrency.py prints them): queueing
    # the step (the model's graph, host work), waiting for the previous step's tokens (the device),
    # handing the tokens to their rows (detokenizing, stops, events)
    build_s: float = 0.0
    wait_s: float = 0.0
    rows_s: float = 0.0


@dataclass
class SessionSteeringInfo(Result):
    """{} (no control vector) or the vector's files, layer_range, mode and direction as the file names them."""
    spec: dict


@dataclass
class CapturedStates(Result):
    last: Any                                 # numpy (prompts, n_layer, n_embd) float64
    first: Any                                # numpy (prompts, n_layer, n_embd) float64
    architecture: str
    seconds: float


def model_id(path: str | Path) -> str:
    """The model's name for clients: the file's stem; a split set's name without its part number."""
    sn = split_name(path)
    return sn.prefix if sn is not None else Path(path).stem
