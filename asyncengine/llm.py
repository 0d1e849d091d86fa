"""LLM: the offline batch API. `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional, Sequence, Union

from tqdm.auto import tqdm

from asyncengine.config import EngineConfig
from asyncengine.engine import LLMEngine, PromptType
from asyncengine.outputs import RequestOutput
from asyncengine.pooling_engine import PoolingEngine, build_engine_on_its_thread, pair_texts
from asyncengine.pooling_params import EmbeddingRequestOutput, PoolingParams, PoolingRequestOutput, ScoringRequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams
from asyncengine.tokenizer import apply_chat_template

Conversation = list[dict[str, Any]]


class LLM:
    """Runs batches of prompts to completion. Keyword arguments are EngineConfig fields (block_size,
    max_num_seqs, max_num_batched_tokens, max_model_len, enable_prefix_caching, dtype, runner, ...). An embedding
    model (runner "pooling", chosen from the checkpoint or by runner=...) is used through `embed`, a cross-encoder
    through `score`."""

    def __init__(self, model: Optional[str] = None, **kwargs: Any):
        # Device work runs on its own thread so that detokenizing one step overlaps the next step on the GPU; the
        # engine is built there too (pooling_engine.build_engine_on_its_thread says why).
        self.engine: Union[LLMEngine, PoolingEngine]
        self.engine, self._device_thread = build_engine_on_its_thread(EngineConfig(model=model, **kwargs),
                                                                      "asyncengine-llm")
        self._counter = 0

    def close(self) -> None:
        """Stop what the engine started (tensor-parallel workers); the LLM cannot generate afterwards.
        Idempotent; also done at interpreter exit."""
        self._device_thread.shutdown(wait=True)
        self.engine.close()

    def reset_prefix_cache(self) -> None:
        """See `LLMEngine.reset_prefix_cache`."""
        self.engine.reset_prefix_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A prompt is a string or a list of token ids; one SamplingParams
        for all, or one per prompt. Bad input raises ValueError before anything runs."""
        self._check_generates()
        prompt_list = self._as_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompt_list)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        ids = self._add_all(prompt_list, params_list)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Union[Conversation, Sequence[Conversation]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Optional[dict] = None,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation or a list of them, then generate."""
        self._check_generates()
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            apply_chat_template(self.engine.tokenizer, c, add_generation_prompt, **(chat_template_kwargs or {}))
            for c in conversations
        ]
        token_lists = [self.engine.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
        return self.generate(token_lists, sampling_params, use_tqdm)

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Optional[PoolingParams] = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a string or a list of token ids), in the order of `prompts`; each output's
        `.outputs.embedding` is a list of floats. With the pooling runner, or on a decoder loaded to generate (last
        token, in its scheduler; LLMEngine.check_prompt). Bad input raises ValueError (see _pool: the prompts are
        tokenized a chunk at a time while earlier chunks run)."""
        self._check_pooling("embed")
        params = pooling_params or PoolingParams()
        prompt_list = self._as_list(prompts)

        def tokenized(chunk: list[PromptType]) -> list[tuple[Optional[PromptType], list[int], PoolingParams]]:
            return [(p, ids, params) for p, ids in zip(chunk, self.engine.tokenize(chunk, params))]

        return self._pool(prompt_list, tokenized, "Embedded prompts", use_tqdm)

    def score(
        self,
        data_1: Union[str, Sequence[str]],
        data_2: Union[str, Sequence[str]],
        truncate_prompt_tokens: Optional[int] = None,
        use_tqdm: bool = True,
        pooling_params: Optional[PoolingParams] = None,
    ) -> list[ScoringRequestOutput]:
        """A cross-encoder's score of text pairs (vLLM's `LLM.score`): data_1 against each text of data_2 (1:N),
        or data_1[i] against data_2[i] (N:N); one output per pair, in order, its `.outputs.score` a float.
        Needs a cross-encoder. Bad input raises ValueError (naming data_1 / data_2) before anything runs."""
        self._check_pooling("score")
        params = replace(pooling_params or PoolingParams(), task="score")
        if truncate_prompt_tokens is not None:
            params = replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        pairs = pair_texts(data_1, data_2, names=("data_1", "data_2"))

        def tokenized(chunk: list[tuple[str, str]]) -> list[tuple[Optional[PromptType], list[int], PoolingParams]]:
            return [(None, ids, replace(params, second_text_start=start))
                    for ids, start in self.engine.tokenize_pairs(chunk, params)]

        return self._pool(pairs, tokenized, "Scored pairs", use_tqdm)

    def _check_pooling(self, what: str) -> None:
        if what == "embed" and isinstance(self.engine, LLMEngine):
            return  # a decoder loaded to generate embeds too (in its scheduler; LLMEngine.check_prompt)
        if not isinstance(self.engine, PoolingEngine):
            raise ValueError(f"{what} needs the pooling runner: this model was loaded to generate "
                             f"(pass runner='pooling' to LLM(...) for an embedding model or a cross-encoder)")

    def _tokenizes_while_passes_run(self) -> bool:
        """True on an accelerator; False on CPU, where the passes use the host's cores, so tokenizing meanwhile
        would only contend with them (measured: slower)."""
        return self.engine.runner.device.type != "cpu"

    def _pool(self, inputs: list, tokenized: Callable[[list], list[tuple[Optional[PromptType], list[int],
                                                                           PoolingParams]]],
              desc: str, use_tqdm: bool) -> list[PoolingRequestOutput]:
        """Run pooling requests over `inputs` (prompts or text pairs); outputs in their order. `tokenized` turns a
        chunk of inputs into (prompt, token ids, params) requests.

        Where the passes leave the host's cores free (_tokenizes_while_passes_run), the inputs are tokenized and
        added a chunk (max_num_seqs inputs: at most one step's worth) at a time: the first before the loop starts,
        each next one while the device runs the step just launched, so that the tokenizer's time overlaps the
        passes instead of preceding them all; elsewhere all in one chunk. A chunk is checked whole before any of
        it is queued; a bad input (ValueError) stops the admission: the chunks already queued run to completion,
        then the error is raised and nothing is returned. So bad input among the first max_num_seqs inputs (and
        bad params) raises before anything runs."""
        chunk = max(1, self.engine.config.max_num_seqs) if self._tokenizes_while_passes_run() else len(inputs)
        chunks = (inputs[i: i + chunk] for i in range(0, len(inputs), chunk))
        ids: list[str] = []
        error: Optional[ValueError] = None

        def admit_next_chunk() -> None:
            nonlocal error
            batch = next(chunks, None) if error is None else None
            if batch is None:
                return
            try:
                requests = tokenized(batch)
                for _, token_ids, params in requests:
                    self.engine.check_prompt(token_ids, params)
            except ValueError as exc:
                error = exc
                return
            for prompt, token_ids, params in requests:
                ids.append(self._next_id())
                self.engine.enqueue(ids[-1], prompt if isinstance(prompt, str) else None, token_ids, params)

        admit_next_chunk()
        results: dict[str, PoolingRequestOutput] = {}
        with tqdm(total=len(inputs), desc=desc, disable=not use_tqdm, dynamic_ncols=True) as bar:
            for outputs in self.engine.run_pipelined(self._device_thread):
                results.update((o.request_id, o) for o in outputs)
                bar.update(len(outputs))
                admit_next_chunk()  # the step just launched runs meanwhile
        if error is not None:
            raise error
        return [results[i] for i in ids]

    def _next_id(self) -> str:
        self._counter += 1
        return f"llm-{self._counter - 1}"

    def _check_generates(self) -> None:
        if isinstance(self.engine, PoolingEngine):
            raise ValueError("this model is served with the pooling runner: it embeds (LLM.embed) and cannot "
                             "generate (pass runner='generate' for a decoder)")

    @staticmethod
    def _as_list(prompts) -> list[PromptType]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string, a list of token ids, or a non-empty list of those")
        return list(prompts)

    def _add_all(self, prompts: list[PromptType], params_list: list[SamplingParams]) -> list[str]:
        for params in {id(p): p for p in params_list}.values():  # bad constraints fail before anything is added
            self.engine.check_structured_outputs(params)
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = self._next_id()
                self.engine.add_request(request_id, prompt, params)
                ids.append(request_id)
        except Exception:
            self.engine.abort_request(ids)  # all or nothing: a bad prompt leaves no half-added batch behind
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            for outputs in self.engine.run_pipelined(self._device_thread):
                for output in outputs:
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        return [results[i] for i in ids]
