"""Tools and environments are refused before anything runs when they cannot work: a tool that does not import or
cannot be described to the model, an environment without ``reset``, a chat template that renders no tool call,
tools with a backend that samples nothing, routed environments without their column, a few-shot demo of an unknown
tool. Each message names the key to change."""

import re

import pytest

from grpo_steps.config import ConfigError, validate_config
from grpo_steps.preflight import check_tools
from grpo_steps.tools.functions import ToolError


def undocumented(x):
    return x


class NoReset:
    def guess(self, number: int) -> str:
        """Guess.

        Args:
            number: The guess.
        """
        return "higher"


class Guess:
    def reset(self, **row) -> None:
        return None

    def guess(self, number: int) -> str:
        """Guess the number.

        Args:
            number: The guess.
        """
        return "higher"


class BadTool(Guess):
    def peek(self, where):
        return 0


@pytest.mark.parametrize("data, named", [
    ({"tools": ["no_such_module:calc"]}, "tools[0] 'no_such_module:calc' does not import"),
    ({"tools": ["grpo_steps.tools:no_such_tool"]}, "does not import"),
    ({"tools": ["calculator"]}, "is not a dotted path"),
    ({"tools": ["grpo_steps.tools"]}, "is not callable"),
    ({"tools": [f"{__name__}:undocumented"]}, "cannot be described to the model as a tool"),
    ({"environment": "no_such_module:Env"}, "environment 'no_such_module:Env' does not import"),
    ({"tools": ["grpo_steps.tools:calculator"], "generation": {"backend": "recorded", "recorded_file": "f"}},
     "backend 'recorded' samples nothing"),
    ({"environment": {"a": f"{__name__}:Guess", "b": f"{__name__}:Guess"}}, "'environment' column"),
    ({"tools": ["grpo_steps.tools:calculator"],
      "data": {"few_shot": [{"question": "1 + 1?", "completion": "Answer: 2",
                             "tool_call": {"name": "abacus", "arguments": {"x": "1 + 1"}, "result": "2"}}]}},
     "tool 'abacus', which is not one of the tools (['calculator'])"),
])
def test_refused_by_the_config(data, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        validate_config(data)


def test_routed_environments_with_their_column_are_accepted():
    cfg = validate_config({"environment": {"a": f"{__name__}:Guess"}, "data": {"columns": ["environment"]}})
    assert cfg.environment == {"a": f"{__name__}:Guess"}


def _start(tiny_model_path, **data):
    check_tools(validate_config({"model": {"name_or_path": tiny_model_path}, **data}), tiny_model_path)


def test_a_chat_template_without_tool_calls_is_refused_naming_the_key(tiny_model_path):
    """The tiny model's template (SmolLM2's, as embedded) renders no tools: start says to set model.chat_template."""
    with pytest.raises(ToolError, match=r"model's own chat template \(model.chat_template: null\) cannot render a "
                                        r"tool-calling exchange.*qwen2_5"):
        _start(tiny_model_path, tools=["grpo_steps.tools:calculator"])
    # TRL's Qwen2.5 template renders them
    check_tools(validate_config({"model": {"name_or_path": tiny_model_path, "chat_template": "qwen2_5"},
                                 "tools": ["grpo_steps.tools:calculator"]}), tiny_model_path)


def test_an_unknown_chat_template_lists_the_shipped_ones(tiny_model_path):
    with pytest.raises(ToolError, match="neither a file nor a template TRL ships.*qwen2_5"):
        check_tools(validate_config({"model": {"name_or_path": tiny_model_path, "chat_template": "qwen9"}}),
                    tiny_model_path)


def test_a_chat_template_file_is_used(tiny_model_path, tmp_path):
    from trl.chat_template_utils import supports_tool_calling  # noqa: F401 - the check start runs

    from grpo_steps.tools.functions import chat_template_text

    path = tmp_path / "template.jinja"
    path.write_text(chat_template_text("qwen2_5"))
    check_tools(validate_config({"model": {"name_or_path": tiny_model_path, "chat_template": str(path)},
                                 "tools": ["grpo_steps.tools:calculator"]}), tiny_model_path)


@pytest.mark.parametrize("factory, named", [
    ("NoReset", "its instances need a reset"),
    ("BadTool", "tool 'peek'.*cannot be described"),
])
def test_an_environment_is_probed_in_start(tiny_model_path, factory, named):
    with pytest.raises(ToolError, match=named):
        check_tools(validate_config({"model": {"name_or_path": tiny_model_path, "chat_template": "qwen2_5"},
                                     "environment": f"{__name__}:{factory}"}), tiny_model_path)


def test_a_chat_template_file_trl_cannot_parse_is_refused(tiny_model_path, tmp_path):
    """A template that renders tool calls but is none TRL knows: TRL would fail to parse the model's calls when the
    trainer starts; start refuses it first."""
    from grpo_steps.tools.functions import chat_template_text

    path = tmp_path / "template.jinja"
    path.write_text("{# my own #}" + chat_template_text("qwen2_5"))
    with pytest.raises(ToolError, match="TRL cannot parse them back"):
        check_tools(validate_config({"model": {"name_or_path": tiny_model_path, "chat_template": str(path)},
                                     "tools": ["grpo_steps.tools:calculator"]}), tiny_model_path)
