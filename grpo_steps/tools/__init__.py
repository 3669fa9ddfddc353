"""What the policy calls during a rollout: tools (``tools:``) and environments (``environment:``), in TRL's contract.

Every call runs under ``generation.tool_timeout_s``: a call that raises (``SystemExit`` included) or times out goes
back to the model as an ``{"error": ...}`` tool message (TRL's tool loop and :mod:`grpo_steps.evaluation.episodes`
alike), and the step goes on; an answer longer than ``generation.max_tool_response_length`` characters is cut before
it is tokenized. The modules, top to bottom (an import-linter layers contract in pyproject.toml):

- :mod:`~grpo_steps.tools.environments`: the environment factories, each instance in a worker process;
- :mod:`~grpo_steps.tools.functions` (the tools, the chat template that renders them, the shipped ``calculator``)
  and :mod:`~grpo_steps.tools.games` (the ``gym:`` and ``textarena:`` adapters; ``module_of``, the one reader of
  the adapter prefix), which import nothing of each other;
- :mod:`~grpo_steps.tools.worker`: the tool's worker process.

**Why two killable workers.** Both kill a worker with its process group past a call's limit, and close every worker
at interpreter exit; they differ where their callers do. A tool is a stateless function, one process per tool for
the whole run: it starts as a fresh ``python -P`` (the working directory, where a tool may write ``json.py``, never
first on ``sys.path``) and speaks JSON lines, the form of the model's arguments, so any answer comes back as JSON or
its text. An environment instance holds an episode's state, one per rollout (dozens a step, a new one after each
killed call): it is forked from a fork server that imported the environment's module once (TextArena's import ~3 s, a
fork ~10 ms) and its calls and answers are Python objects over a pipe (``reset``'s observation, ``outcome``'s dict).
A fresh interpreter per episode would pay the import each time; a fork of the trainer's fork server would run tools
with its ``sys.path`` and pickle their answers.

``grpo_steps.tools:calculator``, the shipped tool's dotted path in configs, stays a name of this package.
"""

from grpo_steps.tools.functions import calculator

__all__ = ["calculator"]
