"""LangChain's standard chat-model suites (langchain-tests) against ChatKVFuse.

The unit suite never loads a model (ChatKVFuse loads its engine lazily). The integration suite answers with
a real FusionEngine over SmolLM2-135M; `max_tokens` is kept small because the suite makes ~40 calls.

Capabilities kvfuse does not have are declared off, so the suite skips their tests with its own reasons:
tool calling ("Test requires tool calling."), tool choice, JSON mode, image / audio / PDF / video inputs and
tool messages with images or PDFs, Anthropic-format inputs, per-call model override (one engine serves one
model: "Model override not supported."). VCR tests are for HTTP providers. Structured output exists
(`with_structured_output`, prompted JSON): the unit suite checks every method / strict combination is accepted;
the integration suite's joke-schema tests are off because SmolLM2-135M at 8 tokens cannot write that JSON
(test_langchain_paths.py tests parsing, validation and the real model's outcome). Usage metadata includes
`input_token_details["cache_read"]` (checked on a prompt that stuffs a precomputed document).
"""
from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")

from langchain_core.messages import AIMessage  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from kvfuse.integrations.langchain import ChatKVFuse  # noqa: E402


class _KVFuseCapabilities:
    """What kvfuse's chat model can do: text in, text out, usage metadata."""

    @property
    def chat_model_class(self) -> type[ChatKVFuse]:
        return ChatKVFuse

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_tool_choice(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_video_inputs(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True


class TestChatKVFuseUnit(_KVFuseCapabilities, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict:
        return {"model": "smollm2-135m"}

    @property
    def standard_chat_model_params(self) -> dict:
        # the unit suite adds api_key="test" for hosted providers; a local engine has no key and ChatKVFuse rejects
        # settings it does not know (the others, timeout and max_retries included, are accepted)
        params = dict(super().standard_chat_model_params)
        params.pop("api_key", None)
        return params

    @property
    def has_structured_output(self) -> bool:
        return True  # with_structured_output accepts every method / strict combination the suite tries


_CACHED_DOC = ("standard-suite-doc", "The Larkspur Observatory was built in 1887 above the harbour town of Dunmore; "
                                      "its first director, Amelia Voss, was born there.")


@pytest.mark.slow
class TestChatKVFuseIntegration(_KVFuseCapabilities, ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _engine(self, smollm2_engine):
        self._fusion_engine = smollm2_engine

    @property
    def chat_model_params(self) -> dict:
        return {"engine": self._fusion_engine, "max_tokens": 8}

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A stuffed prompt over a precomputed document: its tokens are read from the cache."""
        self._fusion_engine.precompute([_CACHED_DOC])
        chat = ChatKVFuse(**self.chat_model_params)
        prompt = f"Context:\n{_CACHED_DOC[1]}\n\nQuestion: when was the observatory built?"
        if stream:
            chunks = list(chat.stream(prompt))
            msg = chunks[0]
            for c in chunks[1:]:
                msg += c
        else:
            msg = chat.invoke(prompt)
        assert msg.usage_metadata["input_token_details"]["cache_read"] > 0  # the suite only checks >= 0
        return msg
