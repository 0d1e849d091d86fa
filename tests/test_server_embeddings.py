"""POST /v1/embeddings on a real server through the official `openai` client: all-MiniLM-L6-v2's embeddings equal
sentence-transformers' (float and base64), OpenAI's input shapes, usage, and errors naming their field."""

from __future__ import annotations

import asyncio
import base64
import random

import httpx
import httpx2
import numpy as np
import openai
import pytest
import torch
from test_embeddings import COSINE_MIN, cosines, minilm_dir, minilm_folder, sentences, st_reference  # noqa: F401
from test_server_harness import ServerThread


@pytest.fixture(scope="module")
def server():
    """In an engine process, as `asyncengine serve` runs it (test_scoring.py's server runs in-process)."""
    with ServerThread(str(minilm_folder()), served_model_name="minilm", engine_process=True) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(st_reference):  # noqa: F811
    """texts (drawn from sentences(100)) -> sentence-transformers' embeddings [N, 384] (float32, CPU)."""
    return lambda texts: torch.stack([st_reference[t] for t in texts])


def mixed_batch(n: int, seed: int) -> list[str]:
    """n inputs drawn at random from the reference sentences of at most 12 words (3 to ~30 tokens: mixed lengths,
    yet cheap enough for 2 CPU cores), in random order."""
    rng = random.Random(seed)
    pool = [t for t in sentences(100) if len(t.split()) <= 12]
    return [rng.choice(pool) for _ in range(n)]


def vectors(response) -> torch.Tensor:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    assert all(d.object == "embedding" for d in response.data)
    return torch.tensor([d.embedding for d in response.data])


def test_float_and_base64_equal_sentence_transformers(client, reference):
    texts = sentences(100)
    expected = reference(texts)
    as_float = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
    assert as_float.object == "list" and as_float.model == "minilm"
    assert cosines(vectors(as_float), expected).min() >= COSINE_MIN
    # Without encoding_format the client asks for base64 and decodes it into floats itself. Two requests may be
    # batched differently by the engine (the engine process steps them as they arrive), which moves the last bits
    # of a float32 sum: the same vectors within 1e-6, not bit for bit.
    decoded_by_client = client.embeddings.create(model="minilm", input=texts)
    torch.testing.assert_close(vectors(decoded_by_client), vectors(as_float), atol=1e-6, rtol=0)
    raw = client.embeddings.create(model="minilm", input=texts[:3], encoding_format="base64")
    ours = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data])
    assert ours.shape == (3, vectors(as_float).shape[1])  # little-endian float32, one vector per input
    np.testing.assert_allclose(ours, vectors(as_float)[:3].numpy(), atol=1e-6, rtol=0)


def test_usage_counts_prompt_tokens(client, server):
    tokenizer = server.engine.tokenizer
    texts = ["hello world", "a somewhat longer sentence to embed"]
    response = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
    tokens = sum(len(tokenizer(t).input_ids) for t in texts)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens


def test_token_id_inputs_equal_text_inputs(client, server):
    tokenizer = server.engine.tokenizer
    texts = sentences(3, seed=11)
    ids = [tokenizer(t).input_ids for t in texts]
    by_text = vectors(client.embeddings.create(model="minilm", input=texts, encoding_format="float"))
    by_ids = vectors(client.embeddings.create(model="minilm", input=ids, encoding_format="float"))
    single = vectors(client.embeddings.create(model="minilm", input=ids[0], encoding_format="float"))
    one_text = vectors(client.embeddings.create(model="minilm", input=texts[0], encoding_format="float"))
    assert torch.allclose(by_ids, by_text, atol=1e-6)
    assert torch.allclose(single[0], by_text[0], atol=1e-6) and torch.allclose(one_text[0], by_text[0], atol=1e-6)


def bad_request(client, **kwargs) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="minilm", encoding_format="float", **kwargs)
    return info.value.body


def test_errors_name_their_field(client):
    assert bad_request(client, input="hi", dimensions=32)["param"] == "dimensions"
    too_long = " ".join(["word"] * 400)
    body = bad_request(client, input=["fine", too_long])
    assert body["param"] == "input" and "256" in body["message"] and "truncate_prompt_tokens" in body["message"]
    assert bad_request(client, input=[])["param"] == "input"
    assert bad_request(client, input=[""])["param"] == "input"
    assert bad_request(client, input=[[1, 2], "mixed"])["param"] == "input"
    assert bad_request(client, input=[[10**9]])["param"] == "input"
    body = bad_request(client, input="hi", extra_body={"truncate_prompt_tokens": 0})
    assert body["param"] == "truncate_prompt_tokens"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="missing", input="hi")


def test_truncate_prompt_tokens_cuts_long_inputs(client, server):
    too_long = " ".join(["word"] * 400)
    response = client.embeddings.create(model="minilm", input=too_long, encoding_format="float",
                                        extra_body={"truncate_prompt_tokens": 100})
    assert response.usage.prompt_tokens == 100
    cut = server.engine.tokenizer(too_long, truncation=True, max_length=100).input_ids
    by_ids = client.embeddings.create(model="minilm", input=cut, encoding_format="float")
    assert torch.allclose(vectors(response), vectors(by_ids), atol=1e-6)


def test_1000_mixed_length_inputs_in_one_request(client, reference, server):
    texts = mixed_batch(1000, seed=12)
    response = client.embeddings.create(model="minilm", input=texts, encoding_format="float")
    assert len(response.data) == 1000
    assert cosines(vectors(response), reference(texts)).min() >= COSINE_MIN
    assert server.engine_idle()


@pytest.mark.slow
def test_1000_concurrent_requests(server, reference):
    """1,000 requests at once from one client over at most 250 connections, without retries: no connection may be
    reset. (They were, before the server's keep-alive timeout outlived the client pool's: see
    cli.DEFAULT_TIMEOUT_KEEP_ALIVE. The client is httpx2's, the openai client's own: httpx 0.28's pool spends
    O(queued x connections) per request, which stalled this process's event loop for over a minute.)"""
    texts = mixed_batch(1000, seed=13)

    async def main():
        limits = httpx2.Limits(max_connections=250)
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300,
                                      http_client=httpx2.AsyncClient(limits=limits, timeout=300)) as aclient:
            responses = await asyncio.gather(*(
                aclient.embeddings.create(model="minilm", input=t, encoding_format="float") for t in texts))
        return torch.tensor([r.data[0].embedding for r in responses])

    ours = asyncio.run(main())
    assert cosines(ours, reference(texts)).min() >= COSINE_MIN
    assert server.engine_idle()


def test_generate_model_refuses_scores_and_pooling_model_refuses_completions(client, llama_dir):
    """(A decoder served to generate embeds too: test_mixed_pooling.py.)"""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="minilm", prompt="hi", max_tokens=2)
    assert "pooling runner" in info.value.body["message"]
    with ServerThread(str(llama_dir)) as generating:
        refused = httpx.post(generating.url + "/score", json={"text_1": "a", "text_2": "b"}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


def test_embedding_model_refuses_scoring(server):
    for path, body in (("/score", {"text_1": "a", "text_2": "b"}), ("/v1/rerank", {"query": "a", "documents": ["b"]})):
        response = httpx.post(server.url + path, json=body, timeout=30)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "model" and "cross-encoder" in response.json()["error"]["message"]


def test_openapi_document_of_an_embedding_server(server):
    document = httpx.get(server.url + "/openapi.json", timeout=10).json()
    operation = document["paths"]["/v1/embeddings"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/EmbeddingRequest"}
    assert set(document["components"]["schemas"]["EmbeddingRequest"]["required"]) == {"input"}
    assert "/v1/completions" not in document["paths"] and "/score" not in document["paths"]
