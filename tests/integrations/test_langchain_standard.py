"""LangChain's standard chat-model suites (langchain-tests) against ChatKVFuse.

The unit suite never loads a model (ChatKVFuse loads its engine lazily). The integration suite answers with
a real FusionEngine over SmolLM2-135M; `max_tokens` is kept small because the suite makes ~40 calls.

Capabilities kvfuse does not have are declared off, so the suite skips their tests with its own reasons:
tool calling ("Test requires tool calling."), tool choice, structured output and JSON mode, image / audio /
PDF / video inputs and tool messages with images or PDFs, Anthropic-format inputs, per-call model override
(one engine serves one model: "Model override not supported."). VCR tests are for HTTP providers.
"""
from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")

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


@pytest.mark.slow
class TestChatKVFuseIntegration(_KVFuseCapabilities, ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _engine(self, smollm2_engine):
        self._fusion_engine = smollm2_engine

    @property
    def chat_model_params(self) -> dict:
        return {"engine": self._fusion_engine, "max_tokens": 8}
