"""docs/configuration.md is the rendering of the config models (grpo_steps/config/reference.py), and what the
rendering says about each field and rule comes from the models."""

import pytest
from pydantic import BaseModel

from grpo_steps.config import ModelConfig, PipelineConfig
from grpo_steps.config.reference import COMMAND, PAGE, render, stale, tree


@pytest.fixture(scope="module")
def page() -> str:
    return render()


def _rule(section: str, name: str):
    return next(rule for s in SECTIONS if s.key == section for rule in s.rules if rule.name == name)


SECTIONS = tree()


def test_the_page_is_the_rendering_of_the_config_models(page):
    """A field, description, default or rule changed without regenerating the page fails here, naming the command."""
    message = stale(PAGE.read_text() if PAGE.exists() else "", page)
    assert message is None, message


def test_a_changed_description_makes_the_page_stale(monkeypatch):
    """The staleness test above is real: the page is rendered from the models, so one changed field description
    (here a ``Field(description=...)`` patched into pydantic's record, which wins over the docstring) gives another
    page, and the check says how to regenerate it."""
    assert stale(render(), render()) is None  # the rendering is deterministic
    monkeypatch.setattr(ModelConfig.model_fields["dtype"], "description", "Another dtype text, not on the page.")
    rendered = render()
    assert "Another dtype text, not on the page." in rendered
    message = stale(PAGE.read_text(), rendered)
    assert message is not None and COMMAND in message and "docs/configuration.md" in message


def test_every_field_is_on_the_page_with_type_default_and_description(page):
    assert SECTIONS[0].model is PipelineConfig
    for section in SECTIONS:
        for dotted, name, info in section.fields:
            assert info.description or section.docs.get(name), f"{dotted} has no docstring"
            assert f"### `{dotted}`" in page
    entry = page.split("### `generation.server.replicas`", 1)[1].split("###", 1)[0]
    assert "`int` · >= 1 · default `1`" in entry and "Generation replicas (vLLM servers)" in entry
    assert "### `generation.async`" in page and "### `registry.register`" in page  # YAML names (aliases)
    assert "### `data.mixture[].weight`" in page and "### `rewards[].timeout_s`" in page  # list items
    assert "### `train.peft.r`" in page  # an optional section



def _entry(page: str, key: str) -> str:
    """The first line of facts under ``### `key``` (type, bounds, default)."""
    return page.split(f"### `{key}`\n\n", 1)[1].split("\n", 1)[0]


def test_an_optional_section_off_by_default_renders_its_null_default(page):
    """A section whose default is None (``generation.async``, ``train.peft``, ``generation.structured_outputs``: off
    until set) shows ``null``, never "the section's defaults", which would say it is on; a section defaulting to an
    instance of its model shows "the section's defaults"."""
    section_keys = {section.key for section in SECTIONS}
    checked = {None: 0, "instance": 0}
    for section in SECTIONS:
        for dotted, _, info in section.fields:
            if dotted not in section_keys:
                continue
            facts = _entry(page, dotted)
            if info.default is None:
                assert facts.endswith(" · default `null`"), f"{dotted}: {facts}"
                checked[None] += 1
            elif isinstance(info.default, BaseModel):
                assert facts.endswith(" · default the section's defaults"), f"{dotted}: {facts}"
                checked["instance"] += 1
    assert checked[None] >= 3 and checked["instance"] >= 10, checked
    for key in ("generation.async", "train.peft", "generation.structured_outputs"):
        assert _entry(page, key).endswith(" · default `null`"), _entry(page, key)

def test_rules_name_the_fields_they_read(page):
    # a cross-section rule reading through local names (train, res = self.train, self.resources)
    assert _rule("", "_one_process_per_gpu").reads == {"train.processes_per_node", "resources.train.gpu"}
    # attribute chains through nested sections
    assert {"data.num_eval", "registry.min_eval_prompts"} <= _rule("", "_gate_has_enough_prompts").reads
    # a field validator reads the fields it is declared for
    assert _rule("generation.server", "_http_url").reads == {"generation.server.endpoint"}
    # a validator data shares with each mixture entry reads the entry's keys there, though its message says data.path
    assert _rule("data.mixture[]", "_file_source_has_a_path").reads == {"data.mixture[].source", "data.mixture[].path"}
    # a top-level key is not found in prose ("registered model names" does not read `model`)
    assert "model" not in _rule("registry", "_registrable_name").reads
    entry = page.split("### `resources.train.gpu`", 1)[1].split("###", 1)[0]
    assert "[`_one_process_per_gpu`](#rule-top-_one_process_per_gpu)" in entry
    assert '<a id="rule-top-_one_process_per_gpu"></a>' in page


def test_rules_show_their_refusal_messages():
    gate = _rule("", "_gate_has_enough_prompts")
    assert gate.messages == ["data.num_eval (…) is below registry.min_eval_prompts (…), the fewest held-out prompts "
                             "the quality gate decides on: raise data.num_eval, or lower registry.min_eval_prompts "
                             "(at least 2)"]
    # a message held in a module constant
    assert _rule("", "_colocate_needs_gpu").messages[0].startswith("generation.mode 'colocate' needs GPUs")
    assert any("must be a base URL" in m for m in _rule("generation.server.router", "_router_url").messages)  # helper
    assert _rule("", "_no_credentials_in_the_tree").text.startswith("Credentials anywhere in the tree are refused")
    names = {rule.name for section in SECTIONS for rule in section.rules}
    assert "_async_true_is_defaults" not in names  # converts `async: true`, refuses nothing
