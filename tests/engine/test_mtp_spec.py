"""Speculative decoding with the model's own NextN/MTP head (`--spec mtp`; engine/generation/mtp_spec.py, issue 36),
on tiny qwen35 / qwen35moe F16 GGUFs whose head the factory writes (random weights: the head's drafts
are mostly rejected, which exercises the rollback of the target's recurrent state on every pass).

Greedy output equals plain decoding; the K/V holds exactly the delivered tokens; after partial
acceptance the head's K/V holds one entry per verified target position, equal to a head run afresh
over the same positions; sampled verification with the head's distributions follows the target's
distribution (chi-square, as test_speculative's lookup/draft test); refusals are one line by name.
"""
from __future__ import annotations

import functools
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.generation import speculative
from engine.engine import Engine, EngineOptions, GenerateRequest, Status
from engine.errors import StrataError
from engine.sampling import SamplingParams
from gguf_factory_qwen35 import write_tiny_qwen35_gguf
from test_speculative import _chi2, _chi2_critical, words
from engine_reads import while_held

PROMPTS = ["the quick brown fox jumps over the lazy dog", words(24), words(12, 40) + " and then " + words(6)]


@pytest.fixture(scope="module")
def mdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mtpspec")


@functools.lru_cache(maxsize=None)
def _file(d: Path, arch: str, nextn: int = 1) -> Path:
    return write_tiny_qwen35_gguf(d / f"{arch}-{nextn}.gguf", arch, nextn=nextn, seed=5)


@pytest.fixture(scope="module")
def engines(mdir):
    """One engine per file, shared by the tests (each start loads the model)."""
    made: dict = {}

    def get(arch: str, nextn: int = 1) -> Engine:
        if (arch, nextn) not in made:
            made[(arch, nextn)] = _engine(_file(mdir, arch, nextn))
        return made[(arch, nextn)]
    yield get
    for e in made.values():
        e.stop()


@pytest.fixture(autouse=True)
def keep_drafting(monkeypatch):
    """A random head's drafts are rejected and a tiny model never gains from drafting: the never-slower
    rule would stop after MIN_JUDGE passes. The mechanics are tested here, so it never judges."""
    monkeypatch.setattr(speculative, "REMEMBER", False)
    monkeypatch.setattr(speculative, "MIN_JUDGE", 10 ** 6)


def _engine(path: Path, **opts) -> Engine:
    """An engine that runs every reply to max_tokens (random weights emit EOS at random)."""
    e = Engine(EngineOptions(model=str(path), cache_mib=0, **opts)).start()
    assert e.call(Status(), timeout=120).model

    def no_eos(eng):
        eng.tokenizer.eos_ids = set()
    while_held(e, no_eos)
    return e


def _gen(e, text, spec, n=32, temperature=0.0, seed=None, **kw):
    sp = SamplingParams(max_tokens=n, temperature=temperature, seed=seed)
    return e.call(GenerateRequest(messages=[{"role": "user", "content": text}], sampling=sp, speculative=spec, **kw),
                  timeout=300)


def _check_kv(e, text, r):
    live = e.conversations.live
    prompt = e.prompts.prompt_tokens(GenerateRequest(messages=[{"role": "user", "content": text}]))
    assert live.tokens == (prompt + r.tokens)[:len(live.tokens)]
    offs = [c.offset for c in live.cache if isinstance(getattr(c, "offset", None), int)]
    assert offs and all(o == len(live.tokens) for o in offs)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_greedy_equals_plain_and_the_kv_holds_the_delivered_tokens(engines, arch):
    e = engines(arch)
    for text in PROMPTS if arch == "qwen35" else PROMPTS[1:]:     # qwen35moe: two, for the time
        plain = _gen(e, text, "off")
        r = _gen(e, text, "mtp")
        assert r.tokens == plain.tokens and len(r.tokens) == 32
        assert r.speculative == "mtp" and r.drafted_tokens > 0 and not r.speculation_stopped
        _check_kv(e, text, r)


def test_bookkeeping_after_partial_acceptance(mdir):
    """The loop, the head and its K/V as they run, with the head's token choice steered (the random head
    is almost never right): per pass both drafts right, the first only, or none, from the plain reply.
    After every propose the head holds one entry per target position (the prompt's included); at the
    end its K/V equals the head run afresh over the target's hidden states of the same positions."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from engine.generation import generate, mtp_spec
    from engine.model.archs.qwen35_mtp import load_head
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.generation.mtp_spec import MTPDrafter

    g = open_gguf(_file(mdir, "qwen35"))
    model, _ = load_model(g)
    head, _ = load_head(g, model)
    prompt = [398, 273, 114, 373, 309, 47, 259, 107, 308, 325, 264, 270]
    greedy = SamplingParams(temperature=0.0)

    def run(drafter=None, n=32):
        cache, fed = make_prompt_cache(model), []
        # the prompt in chunks of 4 through the tap (as the engine's prefill): the head reads it too
        generate.prefill(drafter.target if drafter else model, cache, prompt[:-1], fed, chunk=4, first=4)
        spec = speculative.SpecStats("mtp")
        if drafter is None:
            steps = generate.decode(model, cache, prompt[-1], fed, history=prompt, sampler=greedy.sampler(None),
                                    processors=[], max_tokens=n, stats=generate.StepStats())
        else:
            steps = speculative.decode(drafter.target, cache, prompt[-1], fed, history=prompt, sampling=greedy,
                                       processors=[], max_tokens=n, stats=generate.StepStats(), spec=spec,
                                       drafter=drafter)
        out = list(steps)
        return out, fed, spec

    ref, _, _ = run()
    seen = []

    class Steered(MTPDrafter):
        def propose(self, context, k, target_dist=None):
            self.at, self.i = len(context) - len(prompt), 0
            out = super().propose(context, k, target_dist)
            seen.append((self.held, len(context) - 1 - self.start, len(out)))
            return out

        def pick(self, logits, target_dist):
            super().pick(logits, target_dist)          # the head's own choice is computed, then replaced
            j, self.i = self.at + self.i, self.i + 1
            right = ref[j] if j < len(ref) else 0
            kind = len(seen) % 3                        # 0: both right, 1: the first only, 2: none
            ok = kind == 0 or (kind == 1 and self.i == 1)
            return (right if ok else (right + 1) % 500), None

    d = Steered(head, model, Path("x"), draft_len=2)
    out, fed, spec = run(d)
    assert out == ref
    assert fed == (prompt + out)[:len(fed)]
    assert d.start == 0 and all(held == want for held, want, _ in seen), seen
    assert spec.drafted > spec.accepted > 0 and spec.passes >= 6
    # the head's K/V against a fresh run over the same positions (the target's hidden states from
    # one pass over everything fed)
    tap = mtp_spec.TargetTap(model)
    tap(mx.array(fed)[None], cache=make_prompt_cache(model))
    s, n = d.start, d.held
    fresh = KVCache()
    h = mx.concatenate([tap.rows[p] for p in range(s, s + n)], axis=0)[None]
    head.features(h, mx.array(fed[s + 1:s + n + 1])[None], cache=fresh)
    k_ours, k_fresh = d.cache.keys[..., :n, :], fresh.keys[..., :n, :]
    err = float(mx.max(mx.abs(k_ours - k_fresh)).item())
    # float32; the recurrent layers' chunked vs stepwise paths differ in rounding (measured ~1e-6)
    assert err < 1e-3 * float(mx.max(mx.abs(k_fresh)).item()), err


def test_sampled_verification_with_the_heads_distribution_follows_the_target(mdir):
    """2,000 first tokens: a draft sampled from the head's distribution q, verified against the target's
    p by speculative.verify with q: chi-square against p (as test_speculative's lookup/draft test)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from engine.model.archs.qwen35_mtp import load_head
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    from engine.generation.mtp_spec import TargetTap

    g = open_gguf(_file(mdir, "qwen35"))
    model, _ = load_model(g)
    head, _ = load_head(g, model)
    toks = [398, 273, 114, 373, 309, 47, 259, 107]
    sp = SamplingParams(temperature=1.5, top_p=0.95)
    dist = speculative.target_distribution(sp)
    tap = TargetTap(model)
    # the target read toks[:-1]; the head drafts the token after toks[-1] from h at toks[-2]
    tap(mx.array(toks[:-1])[None], cache=make_prompt_cache(model))
    q = dist(head(tap.rows[len(toks) - 2][None], mx.array([[toks[-1]]]), cache=KVCache())[0, -1][None])[0]
    logits = model(mx.array(toks + [0])[None], cache=make_prompt_cache(model))[0, len(toks) - 1:]
    p = dist(logits[:1])[0]
    mx.random.seed(7)
    firsts, acc = [], 0
    for _ in range(2000):
        d0 = int(mx.random.categorical(mx.log(q)).item())
        n_ok, nxt = speculative.verify(logits, [d0], dist, [q])
        acc += n_ok
        firsts.append(d0 if n_ok else nxt)
    p = np.array(p.tolist())
    counts = np.bincount(firsts, minlength=p.shape[0])
    assert 0.02 * 2000 < acc < 0.98 * 2000, f"the test needs both accepted and rejected drafts ({acc})"
    stat, df = _chi2(counts, p, 2000)
    assert df >= 2 and stat < _chi2_critical(df), f"chi-square {stat:.1f} on {df} df"
    # and it can fail: the same counts against the head's q
    assert _chi2(counts, np.array(q.tolist()), 2000)[0] > _chi2_critical(df)


def test_sampled_mtp_runs_and_keeps_bookkeeping(engines):
    e = engines("qwen35moe")
    r = _gen(e, PROMPTS[1], "mtp", n=32, temperature=0.8, seed=3)
    assert len(r.tokens) == 32 and r.drafted_tokens > 0
    _check_kv(e, PROMPTS[1], r)


def test_refusals_are_one_line_by_name(mdir, engines):
    e = engines("qwen35", 0)
    with pytest.raises(StrataError) as err:
        _gen(e, "hi", "mtp", n=4)
    assert "has no NextN head" in str(err.value) and "\n" not in str(err.value)
    # a head file of another architecture
    with pytest.raises(StrataError, match=r"does not match qwen35-0\.gguf \(architecture qwen35moe vs qwen35\)"):
        _gen(e, "hi", f"mtp:{_file(mdir, 'qwen35moe')}", n=4)
    # the plain reply still works after the refusals
    assert len(_gen(e, "hi", "off", n=4).tokens) == 4
    with pytest.raises(StrataError, match="off, lookup or draft:PATH, or mtp"):
        speculative.parse_spec("mtp:")
    assert speculative.parse_spec("mtp:/a/mtp-x.gguf").label == "mtp:/a/mtp-x.gguf"


def test_control_vector_steers_the_target_only(mdir, tmp_path):
    """With a strong vector on, greedy mtp output equals the steered plain output (verification runs
    through the steered target); the head's block is not wrapped by the steering."""
    from engine.steer.control_vector import SteeringConfig, write_control_vector
    from engine.steer.steering import SteeredLayer
    rng = np.random.default_rng(21)
    vec = tmp_path / "strong.gguf"
    write_control_vector(vec, {n: (rng.standard_normal(256) * 3.0).astype(np.float32) for n in range(1, 4)},
                         model_hint="qwen35")
    e = _engine(_file(mdir, "qwen35"), steering=SteeringConfig(files=((str(vec), 1.0),)))
    try:
        steered = _gen(e, PROMPTS[0], "off", speed_projection=True)
        stock = _gen(e, PROMPTS[0], "off", speed_projection=False)
        assert steered.tokens != stock.tokens
        assert _gen(e, PROMPTS[0], "mtp", speed_projection=True).tokens == steered.tokens
        assert _gen(e, PROMPTS[0], "mtp", speed_projection=False).tokens == stock.tokens
        assert not isinstance(e.drafts.mtp_head.layer, SteeredLayer)
        assert any(isinstance(l, SteeredLayer) for l in e.model.language_model.model.layers)
    finally:
        e.stop()


def test_cli_spec_mtp(mdir, capsys):
    """`strata generate --spec mtp`: the same tokens as --spec off, the head's counts in --json (EOS may end
    both replies early: random weights; equal either way)."""
    import json

    from engine.frontends.cli import main
    outs = {}
    for spec in ("off", "mtp"):
        code = main(["generate", "--model", str(_file(mdir, "qwen35")), "--prompt", PROMPTS[1], "--json",
                     "--max-tokens", "8", "--spec", spec])
        out, err = capsys.readouterr()
        assert code == 0, err
        outs[spec] = json.loads(out)
    assert outs["mtp"]["tokens"] == outs["off"]["tokens"] and outs["mtp"]["speculative"] == "mtp"


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_memory_estimate_counts_the_head(mdir, arch):
    """The load's estimate (and so the guard) holds the head: its weights, equal to the loaded model's plus
    the head's own parameter bytes (measured equal to the byte, F16 in float32), and its K/V layer."""
    from mlx.utils import tree_flatten

    from engine.model.archs.qwen35_mtp import load_head
    from engine.model.gguf_file import open_gguf
    from engine.model.memory_estimate import estimate, read_header
    from engine.model.model_loader import load_model
    path = _file(mdir, arch)
    g = open_gguf(path)
    model, _ = load_model(g)
    head, _ = load_head(g, model)
    held = sum(v.nbytes for _, v in tree_flatten(model.parameters())) + \
        sum(v.nbytes for _, v in tree_flatten(head.parameters()))
    e, plain = (estimate(read_header(p), 2048, "float32") for p in (path, _file(mdir, arch, nextn=0)))
    assert e.weights_bytes == held
    # one full-attention layer in the tiny model (2 x 128 x 1 K/V head x 4 bytes), the head's one more
    assert (plain.kv_bytes_per_token, e.kv_bytes_per_token) == (1024, 2048)


def test_server_speculative_field_mtp(engines, strata_home):
    """The server's "speculative": "mtp": the same reply as without, the head's counts in usage; a model
    without a head answers 400 with the one-line reason."""
    import httpx

    from engine.frontends.server import ServerThread, create_app
    for nextn, ok in ((1, True), (0, False)):
        engine = engines("qwen35", nextn)
        srv = ServerThread(create_app(engine)).start()
        try:
            url = f"{srv.base_url}/chat/completions"
            base = {"messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0, "max_tokens": 12}
            if not ok:
                e = httpx.post(url, json={**base, "speculative": "mtp"}, timeout=120)
                assert e.status_code == 400 and "has no NextN head" in e.json()["error"]["message"]
                # a head file: a name in the models folder only, as a draft model's
                for bad in ("mtp:/etc/passwd", "mtp:../x"):
                    e = httpx.post(url, json={**base, "speculative": bad}, timeout=30)
                    assert e.status_code == 400 and e.json()["error"]["param"] == "speculative", bad
                continue
            plain = httpx.post(url, json=base, timeout=120).json()
            r = httpx.post(url, json={**base, "speculative": "mtp"}, timeout=120).json()
            # the whole message: this template opens a <think> block, so the reply is reasoning_content
            said = plain["choices"][0]["message"]
            assert r["choices"][0]["message"] == said and (said["content"] or said["reasoning_content"])
            assert r["usage"]["speculative"]["drafted_tokens"] > 0 and r["strata"]["speculative"] == "mtp"
        finally:
            srv.stop()


def test_a_qwen35_file_whose_deltanet_qkv_is_not_attention_shaped_loads_with_its_head(mdir):
    """blk.0.attn_qkv of a Qwen3.5 file is the Gated DeltaNet's (2 x 2 x 64 + 8 x 64 = 768 rows here), not
    a fused attention QKV ((2 + 2 x 1) x 128 = 512): the hyperparameter check must not refuse it (it did
    for every real Qwen3.5 shape, e.g. bench/shapes.py's qwen35-0.8b; the tests' default widths agree
    by chance)."""
    from engine.model.archs.qwen35_mtp import load_head
    from engine.model.gguf_file import open_gguf
    from engine.model.model_loader import load_model
    g = open_gguf(write_tiny_qwen35_gguf(mdir / "v8.gguf", "qwen35", n_v_heads=8, nextn=1, seed=5))
    model, info = load_model(g)
    head, _ = load_head(g, model)
    assert info.n_layer == 4 and head.layer is not None


def _write_sibling(src: Path, dest: Path) -> Path:
    """convert_hf_to_gguf's --mtp-only output (as test_qwen35_mtp's): the head's block and the top-level
    tensors of `src`, its metadata."""
    import gguf
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dest), r.fields["general.architecture"].contents())
    layer = int(r.fields[f"{w.arch}.block_count"].contents()) - 1
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, field.contents())
        else:
            w.add_key_value(key, field.contents(), field.types[0])
    for t in r.tensors:
        if t.name.startswith(f"blk.{layer}.") or not t.name.startswith("blk."):
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def test_a_sibling_head_file_found_by_name_or_given_drafts(tmp_path, mdir):
    """A model without nextn.* tensors and an mtp-*.gguf beside it naming it: `mtp` finds it (through
    the memory guard), `mtp:PATH` names it; greedy output equals plain either way."""
    import shutil
    target = shutil.copy(_file(mdir, "qwen35", nextn=0), tmp_path / "qwen35-0.gguf")
    sib = _write_sibling(_file(mdir, "qwen35"), tmp_path / "mtp-qwen35-0.gguf")
    e = _engine(Path(target))
    try:
        plain = _gen(e, PROMPTS[0], "off", n=24)
        for spec in ("mtp", f"mtp:{sib}"):
            r = _gen(e, PROMPTS[0], spec, n=24)
            assert r.tokens == plain.tokens and r.drafted_tokens > 0, spec
        assert e.drafts.mtp_path == sib
    finally:
        e.stop()
