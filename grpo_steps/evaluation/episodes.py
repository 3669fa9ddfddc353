"""Evaluation's rollouts through the generation server: one turn, or with ``tools``/``environment`` a multi-turn
episode (the model's turn, its tool calls run, their answers appended, the next turn, ...).

Training runs TRL's own tool loop (``GRPOTrainer._tool_call_loop`` over
:class:`grpo_steps.training.generation.RolloutBackend`); evaluation runs outside the trainer, so this module runs
the same loop with TRL's parts: prompts rendered as TRL renders them (:func:`rendering_template`), turns parsed by
TRL's ``parse_response``, tool calls run as TRL runs them (an unknown tool or an exception is an ``{"error": ...}``
answer), tool answers appended with the token ids of TRL's ``_get_tool_suffix_ids``, at most
``generation.max_tool_calling_iterations`` rounds within ``generation.max_completion_tokens`` tokens after the
prompt (tool answers included; an answer that would not fit is dropped and the episode ends, as TRL does).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_steps.config import PipelineConfig


@dataclass
class Episode:
    """One rollout: ``messages`` after the prompt (the assistant's turns and the tools' answers, TRL's format),
    ``completion_ids`` (every token after the prompt: the model's and the tool answers'), ``model_tokens`` (those the
    model sampled), ``first_logprobs`` (logprobs of the first turn's tokens), ``tool_calls`` / ``tool_failures``
    (calls made / calls that raised, timed out or named no tool), ``turns`` (assistant turns), ``turn_tokens`` (the
    tokens the model sampled in each turn), ``environment`` (its instance, or None)."""

    messages: list[dict] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    model_tokens: int = 0
    first_logprobs: list[float] = field(default_factory=list)
    tool_calls: int = 0
    tool_failures: int = 0
    turns: int = 0
    turn_tokens: list[int] = field(default_factory=list)
    environment: Any = None

    @property
    def text(self) -> str:
        """The last assistant message's content (what an answer-extracting reward reads)."""
        for message in reversed(self.messages):
            if message.get("role") == "assistant":
                return str(message.get("content") or "")
        return ""


def rendering_template(tokenizer, multi_turn: bool) -> str | None:
    """The chat template TRL renders with (``GRPOTrainer.__init__``): with tools, its training variant when the
    tokenizer's template is not prefix-preserving; else the tokenizer's own (None)."""
    if not multi_turn:
        return None
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    return None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)


class EpisodeSampler:
    """Samples episodes of the weights the server holds for evaluation: :meth:`sample` gives ``n`` per row.

    Args:
        cfg: the run config (``generation``: sampling, tools' limits; ``tools``; ``environment``).
        client: the server's :class:`grpo_steps.servers.client.VLLMClient`.
        tokenizer: the policy's tokenizer, ``model.chat_template`` applied (:func:`grpo_steps.models.load_tokenizer`).
    """

    def __init__(self, cfg: PipelineConfig, client, tokenizer) -> None:
        from grpo_steps.tools.environments import environment_factories
        from grpo_steps.tools.functions import tool_functions

        self.cfg, self.client, self.tokenizer, self.gen = cfg, client, tokenizer, cfg.generation
        self.tools = tool_functions(cfg.tools, self.gen.tool_timeout_s, self.gen.max_tool_response_length)
        self.factories = environment_factories(cfg.environment, self.gen.tool_timeout_s,
                                               self.gen.max_tool_response_length, self.gen.episode_timeout_s)
        self.multi_turn = bool(self.tools or self.factories)
        self.template = rendering_template(tokenizer, self.multi_turn)
        if self.multi_turn:
            from trl.chat_template_utils import add_response_schema

            if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema",
                                                                                 None) is None:
                add_response_schema(tokenizer)  # as TRL does, to parse tool calls

    def _episode_tools(self, environment) -> list:
        from grpo_steps.tools.environments import environment_methods

        if environment is None:
            return list(self.tools)
        return list(self.tools) + [getattr(environment, name) for name in environment_methods(environment)]

    def _render(self, prompt: list[dict], tools: list) -> list[int]:
        ids = self.tokenizer.apply_chat_template(prompt, tools=tools or None, chat_template=self.template,
                                                 add_generation_prompt=True, tokenize=True,
                                                 **self.gen.chat_template_kwargs)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def sample(self, rows: list[dict], n: int, temperature: float, filters: bool = True) -> list[list[Episode]]:
        """``n`` episodes per row (greedy: ``temperature`` 0 and ``n`` 1), sampled with the ``generation`` settings
        (the filters only when ``filters``). Returns P lists of n :class:`Episode`."""
        return self.sample_together([(rows, n, temperature, filters)])[0]

    def sample_together(self, batches: list[tuple[list[dict], int, float, bool]],
                        on_first_turn: Callable[[int], None] | None = None) -> list[list[list[Episode]]]:
        """:meth:`sample` for several ``(rows, n, temperature, filters)`` at once: their first turns are requested
        concurrently (each on its own HTTP session), so that the server batches them together, e.g. an evaluation's
        sampled and greedy completions of the same prompts. Prompts are rendered and turns parsed in the calling
        thread (the tokenizer is not shared between threads). ``on_first_turn(i)`` is called in the calling thread
        when batch ``i``'s first turn has arrived (in the order they arrive; e.g. progress lines). Returns one
        :meth:`sample` result per batch.

        Raises:
            GenerationServerError: the server failed a request.
        """
        prepared = [self._prepare(rows, n) for rows, n, _, _ in batches]
        requests = [(self.gen.sampling_request(filters=filters), temperature) for _, _, temperature, filters in batches]
        if len(batches) == 1:
            firsts = [self._first_turn(self.client, prepared[0][2], batches[0][1], *requests[0])]
            if on_first_turn is not None:
                on_first_turn(0)
        else:
            from concurrent.futures import ThreadPoolExecutor, as_completed

            clients = [self.client] + [self._other_client() for _ in batches[1:]]
            with ThreadPoolExecutor(len(batches), thread_name_prefix="eval-request") as pool:
                futures = {pool.submit(self._first_turn, client, prompt_ids, n, request, temperature): i
                           for i, (client, (_, _, prompt_ids), (_, n, _, _), (request, temperature))
                           in enumerate(zip(clients, prepared, batches, requests, strict=True))}
                for future in as_completed(futures):
                    future.result()  # a failed request raises here, at once
                    if on_first_turn is not None:
                        on_first_turn(futures[future])
                firsts = [future.result() for future in futures]  # dicts keep the order of submission
        return [self._finish(episodes, prompt_ids, tools, first, temperature, request)
                for (episodes, tools, prompt_ids), first, (request, temperature)
                in zip(prepared, firsts, requests, strict=True)]

    def _other_client(self):
        """A client of the same server and model with its own HTTP session (for a concurrent request)."""
        import dataclasses

        client = dataclasses.replace(self.client)
        client.model, client.base_model = self.client.model, self.client.base_model
        return client

    def _prepare(self, rows: list[dict], n: int) -> tuple[list[list[Episode]], list[list[list]], list[list[list[int]]]]:
        """Episodes (an environment each, when configured), their tools and rendered prompt ids, P x n each."""
        environments = [[None] * n for _ in rows]
        prompts = [[row["prompt"]] * n for row in rows]
        if self.factories is not None:  # one environment per episode; reset(**row) may extend the question
            for i, row in enumerate(rows):
                name = row.get("environment") if None not in self.factories else None
                for j in range(n):
                    env = environments[i][j] = self.factories[name]()
                    observation = env.reset(**{k: v for k, v in row.items() if k != "environment" or name is None})
                    if observation is not None:
                        last = row["prompt"][-1]
                        prompts[i][j] = row["prompt"][:-1] + [{**last, "content": last["content"] + observation}]
        episodes = [[Episode(environment=environments[i][j]) for j in range(n)] for i in range(len(rows))]
        tools = [[self._episode_tools(environments[i][j]) for j in range(n)] for i in range(len(rows))]
        prompt_ids = [[self._render(prompts[i][j], tools[i][j]) for j in range(n)] for i in range(len(rows))]
        return episodes, tools, prompt_ids

    def _first_turn(self, client, prompt_ids: list[list[list[int]]], n: int, request: dict,
                    temperature: float) -> list[list[dict]]:
        """The first turn's samples, P x n (HTTP only: safe in a worker thread with a client of its own)."""
        if self.factories is None:  # the n episodes of a row share their prompt: one request with n
            return client.complete([ids[0] for ids in prompt_ids], n, max_tokens=self.gen.max_completion_tokens,
                                   temperature=temperature, request=request)
        flat = client.complete([ids for row_ids in prompt_ids for ids in row_ids], 1,
                               max_tokens=self.gen.max_completion_tokens, temperature=temperature, request=request)
        return [[flat[i * n + j][0] for j in range(n)] for i in range(len(prompt_ids))]

    def _finish(self, episodes: list[list[Episode]], prompt_ids: list[list[list[int]]], tools: list[list[list]],
                first: list[list[dict]], temperature: float, request: dict) -> list[list[Episode]]:
        """Take the first turns, then run the tool rounds of the episodes that called tools."""
        open_episodes = []
        for i, group in enumerate(first):
            for j, sample in enumerate(group):
                episode = episodes[i][j]
                episode.first_logprobs = list(sample["logprobs"])
                self._take_turn(episode, prompt_ids[i][j], sample, tools[i][j])
                if episode.messages[-1].get("tool_calls"):
                    open_episodes.append((episode, prompt_ids[i][j], tools[i][j]))
        for _ in range(self.gen.max_tool_calling_iterations):
            if not open_episodes:
                break
            open_episodes = self._tool_round(open_episodes, temperature, request)
        return episodes

    def _take_turn(self, episode: Episode, prompt_ids: list[int], sample: dict, tools: list) -> None:
        """Append a sampled turn: its tokens, and the assistant message (tool calls parsed, as TRL parses them)."""
        ids = list(sample["completion_ids"])
        if self.multi_turn:
            from trl.chat_template_utils import parse_response

            message = parse_response(self.tokenizer, ids, prefix=prompt_ids + episode.completion_ids, tools=tools)
        else:
            # the text of the sampled ids, as TRL decodes them for the training rewards (not the server's own text: a
            # server that lies would choose what is scored)
            message = {"role": "assistant", "content": self.tokenizer.decode(ids, skip_special_tokens=True)}
        episode.messages.append(message)
        episode.completion_ids += ids
        episode.model_tokens += len(ids)
        episode.turns += 1
        episode.turn_tokens.append(len(ids))

    def _tool_round(self, open_episodes: list, temperature: float, request: dict) -> list:
        """Run the tool calls of each episode's last turn, append their answers, sample the next turn; returns the
        episodes whose new turn calls tools again."""
        from grpo_steps.trl_hooks import tool_suffix_ids

        follow_ups = []
        for episode, prompt_ids, tools in open_episodes:
            answers = [self._call(episode, call, tools) for call in episode.messages[-1]["tool_calls"]]
            # TRL's own token ids of tool answers, as its tool loop appends them
            suffix = tool_suffix_ids(self.tokenizer, self.template, self.gen.chat_template_kwargs, answers)
            if len(episode.completion_ids) + len(suffix) > self.gen.max_completion_tokens:
                continue  # the answers would not fit the completion budget: the episode ends here (TRL drops them)
            episode.messages += answers
            episode.completion_ids += suffix
            follow_ups.append((episode, prompt_ids, tools))
        if not follow_ups:
            return []
        budget = min(self.gen.max_completion_tokens - len(e.completion_ids) for e, _, _ in follow_ups)
        room = self.cfg.model.max_model_len - max(len(p) + len(e.completion_ids) for e, p, _ in follow_ups)
        if min(budget, room) < 1:
            return []
        samples = self.client.complete([p + e.completion_ids for e, p, _ in follow_ups], 1,
                                       max_tokens=min(budget, room), temperature=temperature, request=request)
        still_open = []
        for (episode, prompt_ids, tools), (sample,) in zip(follow_ups, samples, strict=True):
            self._take_turn(episode, prompt_ids, sample, tools)
            if episode.messages[-1].get("tool_calls"):
                still_open.append((episode, prompt_ids, tools))
        return still_open

    def _call(self, episode: Episode, call: dict, tools: list) -> dict:
        """Run one tool call (TRL's rules: a function call by name; an error is the answer)."""
        episode.tool_calls += 1
        function = call.get("function") or {}
        name = function.get("name", call.get("name", "unknown"))
        by_name = {tool.__name__: tool for tool in tools}
        try:
            if call.get("type", "function") != "function":
                raise ValueError(f"Unsupported tool call type: {call.get('type')}")
            if name not in by_name:
                raise ValueError(f"Tool {name} not found.")
            result = by_name[name](**(function.get("arguments") or {}))
            if inspect.isawaitable(result):
                import asyncio

                result = asyncio.run(_awaited(result))
        except Exception as err:  # noqa: BLE001 - the model sees the error as the tool's answer, as in training
            episode.tool_failures += 1
            result = {"error": str(err)}
        return {"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)}


async def _awaited(awaitable):
    return await awaitable


def conversation(messages: list[dict]) -> str:
    r"""An episode's messages as text for the tables: each as ``role: content``, a tool call as ``name(arguments)``.

    >>> conversation([{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
    ...     "name": "calculator", "arguments": {"expression": "2 * 3"}}}]},
    ...     {"role": "tool", "name": "calculator", "content": "6"}, {"role": "assistant", "content": "Answer: 6"}])
    'assistant: calculator({"expression": "2 * 3"})\ntool calculator: 6\nassistant: Answer: 6'
    """
    lines = []
    for message in messages:
        calls = [c.get("function", c) for c in message.get("tool_calls") or []]
        text = " ".join([str(message.get("content") or "")] + [
            f"{c.get('name')}({json.dumps(c.get('arguments') or {})})" for c in calls]).strip()
        who = f"tool {message.get('name')}" if message.get("role") == "tool" else message.get("role", "assistant")
        lines.append(f"{who}: {text}")
    return "\n".join(lines)


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Tool use over ``episodes``: ``tools/call_frequency`` (calls per episode, TRL's definition),
    ``tools/failure_frequency`` (failed calls per call; 0 without calls), ``tools/episodes_with_call`` (share of
    episodes with at least one call) and ``tools/turns_per_episode`` (assistant turns); with games, the
    :func:`game_metrics` too.

    >>> episode_metrics([Episode(tool_calls=2, tool_failures=1, turns=3), Episode(turns=1)])["tools/call_frequency"]
    1.0
    """
    calls = sum(e.tool_calls for e in episodes)
    return {**game_metrics(episodes), "tools/call_frequency": calls / max(len(episodes), 1),
            "tools/failure_frequency": sum(e.tool_failures for e in episodes) / calls if calls else 0.0,
            "tools/episodes_with_call": sum(e.tool_calls > 0 for e in episodes) / max(len(episodes), 1),
            "tools/turns_per_episode": sum(e.turns for e in episodes) / max(len(episodes), 1)}


def game_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Over the episodes whose environment keeps an ``outcome`` (the game adapters of
    :mod:`grpo_steps.tools.games`; none: ``{}``): ``game/solve_rate`` (0..1), ``game/moves_per_solved`` (moves of a
    solved episode, mean; NaN when none is solved), ``game/invalid_moves`` (refused moves per episode) and
    ``game/timed_out`` (episodes ended by ``generation.episode_timeout_s``, a count).

    >>> class Game:
    ...     def __init__(self, **o): self.outcome = o
    >>> game_metrics([Episode(environment=Game(solved=True, moves=3, invalid_moves=1, timed_out=False)),
    ...               Episode(environment=Game(solved=False, moves=6, invalid_moves=0, timed_out=True))])
    {'game/solve_rate': 0.5, 'game/moves_per_solved': 3.0, 'game/invalid_moves': 0.5, 'game/timed_out': 1.0}
    """
    outcomes = [o for o in (getattr(e.environment, "outcome", None) for e in episodes)
                if isinstance(o, dict) and "solved" in o]
    if not outcomes:
        return {}
    solved = [o for o in outcomes if o["solved"]]
    return {"game/solve_rate": len(solved) / len(outcomes),
            "game/moves_per_solved": sum(o.get("moves", 0) for o in solved) / len(solved) if solved else float("nan"),
            "game/invalid_moves": sum(o.get("invalid_moves", 0) for o in outcomes) / len(outcomes),
            "game/timed_out": float(sum(bool(o.get("timed_out")) for o in outcomes))}
