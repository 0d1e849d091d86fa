"""Cross-encoders: `LLM.score` and `POST /score`, `/rerank` (and /v1/...) equal sentence-transformers' CrossEncoder
on the same folder. No cross-encoder ships offline on PyPI, so the tests build a tiny random BERT one
(BertForSequenceClassification, one label) with MiniLM's tokenizer and save it with CrossEncoder itself; its
random classifier is scaled up so that the scores spread over (0, 1) instead of all sitting near 0.5."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from test_embeddings import minilm_folder, sentences
from test_server_harness import ServerThread

from asyncengine import LLM
from asyncengine.pooling_params import PoolingParams

SCORE_ATOL = 1e-5  # float32 on CPU; the scores lie in (0, 1)


def build_cross_encoder(folder: Path) -> Path:
    """A tiny random cross-encoder, saved by sentence-transformers' CrossEncoder (its own files and activation)."""
    from sentence_transformers import CrossEncoder
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    tokenizer = BertTokenizerFast.from_pretrained(minilm_folder())
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128, num_labels=1, initializer_range=0.2)
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():
        model.classifier.weight.mul_(5.0)
    raw = folder.with_name(folder.name + "-raw")
    model.save_pretrained(raw)
    tokenizer.save_pretrained(raw)
    CrossEncoder(str(raw), device="cpu").save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory) -> Path:
    return build_cross_encoder(tmp_path_factory.mktemp("cross-encoder") / "ce")


@pytest.fixture(scope="module")
def reference(cross_encoder_dir):
    """pairs -> CrossEncoder.predict's scores (float32, CPU)."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(cross_encoder_dir), device="cpu")
    return lambda pairs: torch.as_tensor(model.predict(pairs, show_progress_bar=False))


@pytest.fixture(scope="module")
def llm(cross_encoder_dir):
    return LLM(str(cross_encoder_dir), dtype="float32")


def texts(n: int, seed: int) -> list[str]:
    return sentences(n, seed=seed, max_words=25)


def test_llm_score_equals_cross_encoder_one_to_many_and_pairwise(llm, reference):
    assert llm.engine.pooler.score_activation == "sigmoid"  # config_sentence_transformers.json says Sigmoid
    query, documents = "what does a retrieval engine embed", texts(20, seed=1)
    ours = torch.tensor([o.outputs.score for o in llm.score(query, documents, use_tqdm=False)])
    expected = reference([(query, d) for d in documents])
    assert expected.std() > 0.05  # scores that differ: a wrong pairing or token type could not pass
    assert torch.allclose(ours, expected, atol=SCORE_ATOL)
    firsts = texts(20, seed=2)
    outputs = llm.score(firsts, documents, use_tqdm=False)
    assert torch.allclose(torch.tensor([o.outputs.score for o in outputs]),
                          reference(list(zip(firsts, documents))), atol=SCORE_ATOL)
    tokenizer = llm.get_tokenizer()
    assert outputs[0].prompt_token_ids == tokenizer(firsts[0], documents[0]).input_ids


def test_token_types_matter(llm, reference):
    """The second text's token type 1 changes the score (so the equality above proves they are passed)."""
    query, document = "a query", "a document about engines"
    ids = llm.get_tokenizer()(query, document).input_ids
    [as_pair] = llm.score(query, document, use_tqdm=False)
    [all_type_0] = llm._pool([ids], lambda chunk: [(None, i, PoolingParams(task="score")) for i in chunk], "",
                             use_tqdm=False)
    assert abs(as_pair.outputs.score - float(reference([(query, document)])[0])) <= SCORE_ATOL
    assert abs(as_pair.outputs.score - all_type_0.outputs.score) > 1e-3


def test_identity_activation_from_the_checkpoint(cross_encoder_dir, tmp_path, reference):
    folder = tmp_path / "identity"
    shutil.copytree(cross_encoder_dir, folder)
    st_config = json.loads((folder / "config_sentence_transformers.json").read_text())
    st_config["activation_fn"] = "torch.nn.modules.linear.Identity"
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    from sentence_transformers import CrossEncoder

    pairs = [("a query", d) for d in texts(5, seed=3)]
    expected = torch.as_tensor(CrossEncoder(str(folder), device="cpu").predict(pairs, show_progress_bar=False))
    ours = LLM(str(folder), dtype="float32").score([a for a, _ in pairs], [b for _, b in pairs], use_tqdm=False)
    assert torch.allclose(torch.tensor([o.outputs.score for o in ours]), expected, atol=SCORE_ATOL)
    assert torch.allclose(torch.sigmoid(expected), reference(pairs), atol=SCORE_ATOL)  # logits, not probabilities
    st_config["activation_fn"] = "torch.nn.modules.activation.Softmax"
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    with pytest.raises(ValueError, match="config_sentence_transformers.json: activation_fn .*Softmax.* not supported"):
        LLM(str(folder))


def test_bad_score_input_names_the_argument(llm, llama_dir):
    with pytest.raises(ValueError, match="^data_2 has 3 texts for 2 in data_1"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)
    with pytest.raises(ValueError, match="^data_2 must not be empty"):
        llm.score("a", [], use_tqdm=False)
    with pytest.raises(ValueError, match="^data_1 must hold non-empty strings"):
        llm.score("", ["a"], use_tqdm=False)
    with pytest.raises(ValueError, match="input is .* tokens but this model takes at most 128"):
        llm.score("q", " ".join(["word"] * 200), use_tqdm=False)
    [cut] = llm.score("q", " ".join(["word"] * 200), truncate_prompt_tokens=100, use_tqdm=False)
    assert len(cut.prompt_token_ids) == 100
    with pytest.raises(ValueError, match="cross-encoder: it scores text pairs"):
        llm.embed("a text", use_tqdm=False)
    with pytest.raises(ValueError, match="score needs the pooling runner"):
        LLM(str(llama_dir)).score("a", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="scoring text pairs needs a cross-encoder"):
        LLM(str(minilm_folder())).score("a", "b", use_tqdm=False)


# -- the server: /score, /rerank through httpx -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(cross_encoder_dir):
    """In-process (test_server_embeddings.py's server runs in an engine process)."""
    with ServerThread(str(cross_encoder_dir), served_model_name="ce", max_model_len=None) as running:
        yield running


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_score_routes_equal_cross_encoder(server, reference):
    query, documents = "which engine pages its cache", texts(12, seed=4)
    expected = reference([(query, d) for d in documents])
    for path in ("/score", "/v1/score"):
        response = post(server, path, {"model": "ce", "text_1": query, "text_2": documents})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "list" and body["model"] == "ce" and body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == list(range(12)) and body["data"][0]["object"] == "score"
        assert torch.allclose(torch.tensor([d["score"] for d in body["data"]]), expected, atol=SCORE_ATOL)
        tokens = sum(len(server.engine.tokenizer(query, d).input_ids) for d in documents)
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    firsts = texts(12, seed=5)
    pairwise = post(server, "/score", {"text_1": firsts, "text_2": documents}).json()
    assert torch.allclose(torch.tensor([d["score"] for d in pairwise["data"]]),
                          reference(list(zip(firsts, documents))), atol=SCORE_ATOL)
    assert server.engine_idle()


def test_rerank_routes_rank_best_first(server, reference):
    query, documents = "continuous batching keeps accelerators busy", texts(10, seed=6)
    expected = reference([(query, d) for d in documents])
    order = sorted(range(10), key=lambda i: -float(expected[i]))
    for path in ("/rerank", "/v1/rerank"):
        body = post(server, path, {"model": "ce", "query": query, "documents": documents, "top_n": 3}).json()
        assert body["model"] == "ce" and body["id"].startswith("rerank-")
        assert [r["index"] for r in body["results"]] == order[:3]
        for result in body["results"]:
            assert result["document"] == {"text": documents[result["index"]]}
            assert abs(result["relevance_score"] - float(expected[result["index"]])) <= SCORE_ATOL
    every = post(server, "/rerank", {"query": query, "documents": documents}).json()  # top_n 0: all of them
    assert [r["index"] for r in every["results"]] == order
    assert every["usage"]["prompt_tokens"] == sum(len(server.engine.tokenizer(query, d).input_ids) for d in documents)


def error(server, path: str, body: dict, status: int = 400) -> dict:
    response = post(server, path, body)
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_bad_score_requests_name_their_field(server):
    assert error(server, "/rerank", {"query": "q", "documents": []})["param"] == "documents"
    assert error(server, "/rerank", {"query": "q", "documents": ["a", ""]})["param"] == "documents"
    assert error(server, "/rerank", {"query": "", "documents": ["a"]})["param"] == "query"
    assert error(server, "/rerank", {"query": "q", "documents": ["a"], "top_n": -1})["param"] == "top_n"
    mismatched = error(server, "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert mismatched["param"] == "text_2" and "3 texts for 2" in mismatched["message"]
    assert error(server, "/score", {"text_1": "a", "text_2": []})["param"] == "text_2"
    assert error(server, "/score", {"text_2": "a"})["param"] == "text_1"
    too_long = error(server, "/v1/score", {"text_1": "q", "text_2": ["ok", " ".join(["word"] * 200)]})
    assert too_long["param"] == "text_2" and "truncate_prompt_tokens" in too_long["message"]
    body = {"text_1": "q", "text_2": "b", "truncate_prompt_tokens": 0}
    assert error(server, "/score", body)["param"] == "truncate_prompt_tokens"
    assert error(server, "/score", {"model": "other", "text_1": "a", "text_2": "b"}, 404)["param"] == "model"
    embeddings = error(server, "/v1/embeddings", {"input": "a text"})
    assert embeddings["param"] == "model" and "/score and /rerank" in embeddings["message"]
    assert server.engine_idle()


def test_openapi_document_of_a_scoring_server(server):
    document = httpx.get(server.url + "/openapi.json", timeout=10).json()
    paths = document["paths"]
    assert {"/score", "/v1/score", "/rerank", "/v1/rerank"} <= set(paths)
    assert "/v1/completions" not in paths and "/v1/embeddings" not in paths and "x-websockets" not in document
    schemas = document["components"]["schemas"]
    assert set(schemas["RerankRequest"]["required"]) == {"query", "documents"}
    assert schemas["RerankRequest"]["properties"]["top_n"]["minimum"] == 0
    assert paths["/rerank"]["post"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/RerankResponse"}
