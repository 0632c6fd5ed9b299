"""The profile join of benchmarks/loop_profile.py: a compiled loop's instructions carry the stack that traced them,
so a profiler's kernels (named by instruction) are charged to the functions the loop called. The GPU trace
itself is exercised where there is one; here the kernels are the program's own instructions."""
from __future__ import annotations

import re

import pytest

from benchmarks.device_trace import Kernel
from benchmarks.hlo_source import Frame, charged_to, instruction_stacks, launches_per_iteration
from benchmarks.loop_profile import LOOP_FILE, charged, compiled_loop, loop_profile
from specjax import LLM, SamplingParams


@pytest.fixture(autouse=True)
def _compiled_afresh():
    """These tests read source lines from compiled programs, and the persistent compilation cache keys a program
    without them: after an edit that moves a test's lines, a cached program would report the old ones."""
    import jax
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", before)


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("llama")


def test_a_kernel_is_charged_to_the_call_the_loop_made():
    stack = (Frame("engine/draft_tree.py", "_best_children", 126), Frame("engine/draft_tree.py", "grow", 105),
             Frame("engine/proposers/eagle.py", "HeadProposer.propose_tree", 180),
             Frame(LOOP_FILE, "_tree_step.<locals>.step", 293), Frame(LOOP_FILE, "generate", 62))
    assert charged_to(stack) == "engine/draft_tree.py:_best_children"
    assert charged_to(stack, LOOP_FILE) == "engine/proposers/eagle.py:HeadProposer.propose_tree"
    assert charged_to(stack[3:], LOOP_FILE) == f"{LOOP_FILE}:_tree_step.<locals>.step"
    assert charged_to(stack[:2], LOOP_FILE) == "engine/draft_tree.py:_best_children"
    assert charged_to((), LOOP_FILE) == "?"


def test_the_compiled_loop_names_who_made_each_instruction(tiny_dir, default_model_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(str(tiny_dir), tokenizer=str(default_model_dir), max_model_len=128, max_num_seqs=2,
              speculative_config=spec)
    prompts, params = [[5, 6, 7, 5, 6], [9, 8, 9, 8]], SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    text = compiled_loop(llm, prompts, params).as_text()
    stacks = instruction_stacks(text)
    fusions = re.findall(r"^\s*(?:ROOT )?%?([\w.-]+) = \S+ fusion\(", text, re.M)
    assert fusions and sum(name in stacks for name in fusions) >= 0.9 * len(fusions)
    kernels = [Kernel(name, name, 0.0, 1000.0) for name in fusions] + [Kernel("x", "not-in-module", 0.0, 1000.0)]
    by_call = {row["function"]: row for row in charged(kernels, stacks, per=2, caller=LOOP_FILE, top=100)}
    assert "models/llama.py:LlamaForCausalLM.__call__" in by_call            # the target's passes
    assert any(name.startswith("engine/proposers/ngram.py") for name in by_call)   # the drafting
    assert by_call["?"]["kernels"] >= 0.5                                     # the kernel the module does not name
    assert sum(row["us"] for row in by_call.values()) == pytest.approx(len(kernels) / 2)


def test_a_nested_loop_launches_its_body_trip_count_times():
    """Per iteration of the outer loop of unknown length, the inner loop's three iterations launch three times
    what the same work once launches."""
    import collections

    import jax
    import jax.numpy as jnp

    def f(x, w, n):
        def body(c):
            i, x = c
            x = jax.lax.fori_loop(0, 3, lambda j, y: jnp.tanh(y @ w), x)
            return i + 1, jnp.tanh(x @ w)
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    inner_line = f.__code__.co_firstlineno + 3
    text = jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((8, 8)), 5).compile().as_text()
    stacks, by_line = instruction_stacks(text), collections.Counter()
    for instruction, times in launches_per_iteration(text).items():
        by_line[stacks[instruction][0].line if stacks.get(instruction) else None] += times
    assert by_line[inner_line] == 3 * by_line[inner_line + 1] > 0


def test_an_instruction_of_several_outputs_launches_like_any_other():
    """A top-k writes values and indices: its instruction's shape is a tuple (as a multi-output fusion's, an
    argmax's variadic reduce's), and it runs as a kernel of its own all the same."""
    import jax
    import jax.numpy as jnp

    def f(x, w, n):
        def body(c):
            i, x = c
            values, indices = jax.lax.top_k(x @ w, 2)
            return i + 1, x + values.sum() + indices.sum()
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    top_k_line = f.__code__.co_firstlineno + 3
    text = jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((8, 8)), 5).compile().as_text()
    stacks = instruction_stacks(text)
    tuple_shaped = set(re.findall(r"^\s*(?:ROOT )?%?([\w.-]+) = \(", text, re.M))
    assert any(i in tuple_shaped and stacks.get(i, (Frame("", "", 0),))[0].line == top_k_line
               for i in launches_per_iteration(text))


def test_a_boolean_conditional_counts_its_costliest_branch_however_it_is_printed():
    """The CPU compiler prints a lax.cond's branches as a list, the GPU compiler as a true/false pair: the
    launches per iteration are the same either way (the pair's were missed before)."""
    import jax
    import jax.numpy as jnp

    def f(x, w, n):
        def body(c):
            i, x = c
            return i + 1, jax.lax.cond(jnp.sum(x) > 0, lambda y: jnp.tanh(y @ w), lambda y: y * 2.0, x)
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    text = jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((8, 8)), 5).compile().as_text()
    as_pair = re.sub(r"branch_computations=\{%?([\w.-]+), %?([\w.-]+)\}", r"true_computation=%\2, false_computation=%\1",
                     text)
    assert as_pair != text
    assert launches_per_iteration(as_pair) == launches_per_iteration(text)
    assert sum(launches_per_iteration(text).values()) > 1


def test_the_outermost_loop_is_the_one_counted_even_where_an_inner_one_is_larger():
    """Segments of steps, each an inner loop of unknown length (behind a switch here); the count is the outer
    loop's iteration (its costliest branch's segment counted once), not a segment's."""
    import jax
    import jax.numpy as jnp

    def f(x, w, n):
        def segment(depth):
            def step(c):
                j, y = c
                for _ in range(depth):
                    y = jnp.tanh(y @ w) + 1.0
                return j + 1, y
            return lambda y: jax.lax.while_loop(lambda c: c[0] < n, step, (0, y))[1]

        def body(c):
            i, x = c
            x = jnp.sin(x @ w)
            return i + 1, jax.lax.switch(i % 2, [segment(1), segment(6)], x)
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    outer_line = f.__code__.co_firstlineno + 11
    text = jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((8, 8)), 5).compile().as_text()
    stacks = instruction_stacks(text)
    lines = {stacks[i][0].line for i in launches_per_iteration(text) if stacks.get(i)}
    assert outer_line in lines


def test_the_profile_counts_launches_by_what_the_loop_called(tiny_dir, default_model_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(str(tiny_dir), tokenizer=str(default_model_dir), max_model_len=128, max_num_seqs=1,
              speculative_config=spec)
    profile = loop_profile(llm, [[5, 6, 7, 5, 6]], SamplingParams(temperature=0.0, max_tokens=8))
    calls = {row["function"]: row["launches"] for row in profile["launches_by_loop_call"]}
    assert calls["models/llama.py:LlamaForCausalLM.__call__"] > 0
    assert profile["launches_per_iteration"] >= sum(calls.values())
