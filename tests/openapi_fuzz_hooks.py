"""Schemathesis hooks for tests/test_openapi_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

One check, `positive_data_acceptance_within_rules`, replaces Schemathesis' `positive_data_acceptance`: it is that
check, unchanged, except for the rules JSON Schema cannot state. A schema-valid request may break them and then
gets a 400 that says so, as vLLM and OpenAI answer:
- prompt tokens + max_tokens > max_model_len: code "context_length_exceeded" (OpenAI's code);
- min_tokens > max_tokens: param "min_tokens", the message naming max_tokens;
- messages the model's own chat template refuses (the default model's accepts no "tool" role, which other models'
  templates render): param "messages", the message saying the chat template failed;
- tools and tool_choice between themselves (tool_calls.py): a named tool_choice must be one of the tools, tool
  names unique, each parameters schema an object schema that compiles: param "tools" or "tool_choice" (the rules
  the schema does state, such as tool_choice needing tools, are not excused);
- a structured-output constraint whose text does not parse or compile (a `json` string that is not JSON, a regex
  or grammar xgrammar refuses): param structured_outputs.* or response_format, "is not valid JSON" / "does not
  compile". Empty regexes, grammars and choices are stated (minLength / minItems) and not excused.
Every other 400 for a schema-valid request still fails the run.
"""

from __future__ import annotations

import json

import schemathesis
from schemathesis.core.failures import Failure
from schemathesis.specs.openapi.checks import positive_data_acceptance


def _breaks_a_rule_the_schema_cannot_state(response) -> bool:
    if response.status_code != 400:
        return False
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    if error.get("code") == "context_length_exceeded":
        return True
    if error.get("param") == "messages" and error.get("message", "").startswith("chat template failed"):
        return True
    # a constraint's text is JSON, a regex or a grammar: whether it parses and compiles is xgrammar's to say
    if str(error.get("param")).startswith(("structured_outputs", "response_format")) and any(
            words in error.get("message", "") for words in ("is not valid JSON", "does not compile")):
        return True
    if error.get("param") in ("tools", "tool_choice") and "tool_choice other than" not in error.get("message", "") \
            and "needs a server started with" not in error.get("message", ""):
        return True
    return error.get("param") == "min_tokens" and "max_tokens" in error.get("message", "")


@schemathesis.check
def positive_data_acceptance_within_rules(ctx, response, case):
    """Schema-valid requests are accepted, unless they break a rule between fields (see the module docstring)."""
    try:
        return positive_data_acceptance(ctx, response, case)
    except Failure:
        if _breaks_a_rule_the_schema_cannot_state(response):
            return None
        raise
