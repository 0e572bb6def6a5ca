"""No request stops the engine: the real engine on the template family with faults injected into one request's
logits, its event handler, its sampling parameters, a tier's keep and restore, and the device. A fault fails only
the requests it concerns (the others get their exact solo tokens) and memory comes back exactly; a lost device, or
a loop that cannot go on, leaves the engine dead with every request failed and every later one refused."""

from __future__ import annotations

import queue

import pytest
import torch

from tensorfold.engine.api import DeviceLost, DoneEvent, ErrorEvent, Event, Request, Sampling, TokenEvent
from tensorfold.engine.runner import FAILED_STEPS_DEAD, Engine
from tensorfold.service import EngineDead
from tensorfold.shard import RankLost
from tensorfold.testing import kit
from tensorfold.testing.engine_gates import Rig
from tensorfold.tiers import DeviceTier

RIG = Rig(context=128, chunk=32, min_chunk=8, page_rows=16, max_waiting=8)
TRIGGER = 499  # a prompt that starts with this token is the one a fault picks
GREEDY = Sampling(temperature=0.0, max_tokens=8)
SEEDED = Sampling(temperature=1.0, seed=3, max_tokens=8)


def prompt(n: int, salt: int, first: int | None = None) -> tuple[int, ...]:
    """`n` tokens of the tiny vocabulary, TRIGGER-free unless `first` is TRIGGER."""
    body = tuple((i * 31 + salt * 17) % 490 + 3 for i in range(n))
    return body if first is None else (first, *body[1:])


@pytest.fixture(scope="module")
def subject(example, tiny_dir):
    return kit.load(example, tiny_dir)


class Collect:
    """One request's tokens and the event that ended it."""

    def __init__(self, name: str, tokens: tuple[int, ...], sampling: Sampling) -> None:
        self.tokens: list[int] = []
        self.ended: queue.Queue[Event] = queue.Queue()
        self.request = Request(name, tokens, sampling, self.on_event)

    def on_event(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.tokens.append(event.token_id)
        else:
            self.ended.put(event)

    def end(self, timeout: float = 60.0) -> DoneEvent | ErrorEvent:
        """The event that ended the request (exactly one: a second would be a bug)."""
        event = self.ended.get(timeout=timeout)
        assert self.ended.empty()
        return event


class RaisingHandler(Collect):
    """A receiver whose handler raises on its first token."""

    def on_event(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            raise RuntimeError("the handler broke")
        super().on_event(event)


class NanRows:
    """The real model, except that a sampled row of a share that starts a prompt with TRIGGER is NaN; records
    how many rows each step sampled and which steps held a NaN row."""

    def __init__(self, model) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.sampled: list[int] = []
        self.poisoned: list[int] = []

    def forward(self, plan, kv):
        logits = self.model.forward(plan, kv)
        rows = [share for share in plan.streams if share.sample]
        self.sampled.append(len(rows))
        for row, share in enumerate(rows):
            if share.start == 0 and share.tokens[0] == TRIGGER:
                logits[row] = float("nan")
                self.poisoned.append(len(self.sampled) - 1)
        return logits


class Raising:
    """The real model, except that a step feeding TRIGGER raises `error`, or every step when `always`."""

    def __init__(self, model, error: BaseException, always: bool = False) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.error = error
        self.always = always

    def forward(self, plan, kv):
        if self.always or any(TRIGGER in share.tokens for share in plan.streams):
            raise self.error
        return self.model.forward(plan, kv)


class FaultyTier(DeviceTier):
    """The real device tier with faults switched on by the test: keeping a TRIGGER prompt raises (cleanly, or
    after taking its page holds: a leak), restoring raises while `restores_fail`, checking raises `check_error`."""

    def __init__(self, memory, budget: int, leak: bool = False) -> None:
        super().__init__(memory, budget)
        self.leak = leak
        self.restores_fail = False
        self.check_error: BaseException | None = None

    def keep(self, state) -> bool:
        if state.tokens[0] == TRIGGER:
            if self.leak:
                self.memory.pool.keep(state.pages)
            raise RuntimeError("the tier broke while keeping")
        return super().keep(state)

    def restore(self, state, claim) -> None:
        if self.restores_fail:
            raise RuntimeError("the tier broke while restoring")
        super().restore(state, claim)

    def check_integrity(self) -> None:
        if self.check_error is not None:
            raise self.check_error
        super().check_integrity()


def engine_of(subject, model=None, parallel: int = 2, tier: DeviceTier | None = None,
              memory=None) -> Engine:
    """An engine on the rig over `model` (the real one by default); not started."""
    memory = memory or RIG.memory(subject, parallel=parallel)
    return Engine(model or subject.model, memory, prefill_chunk=RIG.chunk, context=RIG.context,
                  max_waiting=RIG.max_waiting, min_chunk=RIG.min_chunk, tier=tier)


def solo(subject, tokens: tuple[int, ...], sampling: Sampling) -> list[int]:
    """The request's tokens alone on a fresh engine over the real model."""
    engine = engine_of(subject)
    engine.start()
    try:
        alone = Collect("solo", tokens, sampling)
        engine.submit(alone.request)
        assert isinstance(alone.end(), DoneEvent)
    finally:
        engine.close()
    return alone.tokens


def run_together(engine: Engine, *clients: Collect) -> None:
    """Queue every client before the loop starts (so they share its first steps), then run until each ended."""
    for client in clients:
        engine.submit(client.request)
    engine.start()
    for client in clients:
        client.ended.put(client.ended.get(timeout=60))  # wait, and leave the event for the test to read


def assert_memory_exact(engine: Engine) -> None:
    """After close(): the engine is alive, its last idle check passed and every slot and leased page is back."""
    assert engine.failure is None and engine.integrity == "ok"
    memory = engine.memory
    memory.check_integrity()
    for tier in engine.tiers:
        tier.check_integrity()
    assert memory.slots.free == memory.slots.count and memory.pool.leased == 0
    assert engine.snapshot()["running"] == engine.snapshot()["waiting"] == 0


def test_a_top_p_that_rounds_to_zero_samples_the_most_likely_token(subject):
    tokens = prompt(12, 1)
    engine = engine_of(subject)
    tiny = Collect("tiny-top-p", tokens, Sampling(temperature=1.0, top_p=1e-46, max_tokens=4))
    try:
        run_together(engine, tiny)
        assert tiny.end() == DoneEvent("length", len(tokens), 4, 0)
        again = Collect("after", tokens, Sampling(temperature=0.0, max_tokens=4))
        engine.submit(again.request)
        assert isinstance(again.end(), DoneEvent)
    finally:
        engine.close()
    assert tiny.tokens == again.tokens == solo(subject, tokens, Sampling(temperature=0.0, max_tokens=4))
    assert_memory_exact(engine)


def test_nan_logits_fail_their_request_and_the_other_stream_of_the_step_goes_on(subject):
    model = NanRows(subject.model)
    engine = engine_of(subject, model)
    poisoned = Collect("nan", prompt(10, 2, first=TRIGGER), SEEDED)
    other = Collect("other", prompt(12, 3), SEEDED)
    try:
        run_together(engine, poisoned, other)
    finally:
        engine.close()
    assert poisoned.end() == ErrorEvent("the engine failed this request: NonFiniteLogits: the model's logits hold "
                                        f"NaN for {subject.model.vocab_size} of {subject.model.vocab_size} tokens")
    assert poisoned.tokens == []
    assert model.poisoned == [0] and model.sampled[0] == 2  # both streams sampled in the step that held the NaN
    assert other.end() == DoneEvent("length", 12, 8, 0)
    assert other.tokens == solo(subject, prompt(12, 3), SEEDED)
    assert_memory_exact(engine)


def test_an_event_handler_that_raises_fails_only_its_stream(subject):
    engine = engine_of(subject)
    broken = RaisingHandler("broken", prompt(10, 4), GREEDY)
    other = Collect("other", prompt(12, 5), GREEDY)
    try:
        run_together(engine, broken, other)
    finally:
        engine.close()
    assert broken.end() == ErrorEvent("the engine failed this request: RuntimeError: the handler broke")
    assert other.end() == DoneEvent("length", 12, 8, 0)
    assert other.tokens == solo(subject, prompt(12, 5), GREEDY)
    assert_memory_exact(engine)


def test_an_admission_that_raises_fails_only_its_request(subject):
    engine = engine_of(subject)
    unreadable = Collect("nan-temperature", prompt(10, 6), Sampling(temperature=float("nan"), max_tokens=4))
    other = Collect("other", prompt(12, 7), SEEDED)
    try:
        run_together(engine, unreadable, other)
    finally:
        engine.close()
    assert unreadable.end() == ErrorEvent("the engine failed this request: ValueError: sampling temperature must "
                                          "be a finite number of at least 0, got nan")
    assert other.end() == DoneEvent("length", 12, 8, 0)
    assert other.tokens == solo(subject, prompt(12, 7), SEEDED)
    assert_memory_exact(engine)


def test_a_keep_that_raises_fails_only_its_request(subject):
    memory = RIG.memory(subject)
    tier = FaultyTier(memory, budget=1 << 30)
    engine = engine_of(subject, tier=tier, memory=memory)
    unkept = Collect("unkept", prompt(40, 8, first=TRIGGER), GREEDY)  # kept at its prompt end, 40
    other = Collect("other", prompt(40, 9), GREEDY)
    try:
        run_together(engine, unkept, other)
    finally:
        engine.close()
    assert unkept.end() == ErrorEvent("the engine failed this request: RuntimeError: the tier broke while keeping")
    assert unkept.tokens == []
    assert other.end() == DoneEvent("length", 40, 8, 0)
    assert other.tokens == solo(subject, prompt(40, 9), GREEDY)
    assert [state.at for state in tier.states] == [40]  # the other's state was kept
    assert_memory_exact(engine)


def test_a_restore_that_raises_fails_only_its_request_and_the_state_serves_later(subject):
    memory = RIG.memory(subject)
    tier = FaultyTier(memory, budget=1 << 30)
    engine = engine_of(subject, tier=tier, memory=memory)
    first = prompt(RIG.chunk, 10)  # kept at its end, a cut of the grid: the longer prompt resumes there
    longer = first + prompt(12, 11)
    try:
        run_together(engine, kept := Collect("first", first, GREEDY))
        assert kept.end() == DoneEvent("length", RIG.chunk, 8, 0)
        tier.restores_fail = True
        resumer, other = Collect("resumer", longer, GREEDY), Collect("other", prompt(12, 12), GREEDY)
        engine.submit(resumer.request)
        engine.submit(other.request)
        assert resumer.end() == ErrorEvent("the engine failed this request: RuntimeError: the tier broke while "
                                           "restoring")
        assert other.end() == DoneEvent("length", 12, 8, 0)
        tier.restores_fail = False
        again = Collect("again", longer, GREEDY)
        engine.submit(again.request)
        assert again.end() == DoneEvent("length", len(longer), 8, RIG.chunk)
    finally:
        engine.close()
    assert resumer.tokens == []
    assert other.tokens == solo(subject, prompt(12, 12), GREEDY)
    assert again.tokens == solo(subject, longer, GREEDY)
    assert_memory_exact(engine)


def test_a_failure_that_breaks_memory_integrity_stops_the_engine(subject):
    memory = RIG.memory(subject)
    tier = FaultyTier(memory, budget=1 << 30, leak=True)
    engine = engine_of(subject, tier=tier, memory=memory)
    leaky = Collect("leaky", prompt(40, 13, first=TRIGGER), GREEDY)
    try:
        run_together(engine, leaky)
        assert leaky.end() == ErrorEvent("the engine failed this request: RuntimeError: the tier broke while keeping")
        reason = engine.wait_failed(timeout=60)
        later = Collect("later", prompt(12, 14), GREEDY)
        with pytest.raises(EngineDead) as refused:
            engine.submit(later.request)
    finally:
        engine.close()
    assert reason == engine.failure == str(refused.value) == (
        "memory integrity does not hold after a failure (leaky: RuntimeError: the tier broke while keeping): "
        "kept states hold 0 page references, the pool counts 2")
    assert engine.snapshot()["failure"] == reason


@pytest.mark.parametrize("error", [DeviceLost("the test device is gone"),
                                   RuntimeError("CUDA error: an illegal memory access was encountered"),
                                   torch.AcceleratorError("CUDA error: unspecified launch failure")],
                         ids=["DeviceLost", "cuda-runtime-error", "AcceleratorError"])
def test_a_lost_device_stops_the_engine_and_fails_every_request(subject, error):
    engine = engine_of(subject, Raising(subject.model, error))
    running = Collect("running", prompt(8, 15), GREEDY)
    trigger = Collect("trigger", prompt(8, 16, first=TRIGGER), GREEDY)
    waiting = Collect("waiting", prompt(8, 17), GREEDY)  # two slots: it waits behind the other two
    reason = f"the device is lost: {type(error).__name__}: {error}"
    try:
        run_together(engine, running, trigger, waiting)
        assert engine.wait_failed(timeout=60) == engine.failure == reason
        with pytest.raises(EngineDead, match="the device is lost"):
            engine.submit(Collect("later", prompt(8, 18), GREEDY).request)
    finally:
        engine.close()
    for client in (running, trigger, waiting):
        assert client.end() == ErrorEvent(f"the engine stopped: {reason}") and client.tokens == []
    now = engine.snapshot()
    assert (now["failure"], now["running"], now["waiting"]) == (reason, 0, 0)
    assert now["slots_free"] == now["slots"] and now["leases"] == 0


def test_steps_that_keep_failing_stop_the_engine(subject):
    engine = engine_of(subject, Raising(subject.model, RuntimeError("boom"), always=True), parallel=1)
    clients = [Collect(f"r{i}", prompt(8, 19 + i), GREEDY) for i in range(FAILED_STEPS_DEAD)]
    try:
        run_together(engine, *clients)
        reason = engine.wait_failed(timeout=60)
    finally:
        engine.close()
    assert reason == f"{FAILED_STEPS_DEAD} steps in a row failed, the last with RuntimeError: boom"
    assert [c.end() for c in clients] == [ErrorEvent("the engine failed this request: RuntimeError: boom")] * (
        FAILED_STEPS_DEAD - 1) + [ErrorEvent(f"the engine stopped: {reason}")]


def test_one_failed_step_does_not_stop_the_engine(subject):
    engine = engine_of(subject, Raising(subject.model, RuntimeError("boom")))
    trigger = Collect("trigger", prompt(8, 22, first=TRIGGER), GREEDY)
    try:
        run_together(engine, trigger)
        after = Collect("after", prompt(12, 23), GREEDY)
        engine.submit(after.request)
        assert after.end() == DoneEvent("length", 12, 8, 0)
    finally:
        engine.close()
    assert trigger.end() == ErrorEvent("the engine failed this request: RuntimeError: boom")
    assert after.tokens == solo(subject, prompt(12, 23), GREEDY)
    assert_memory_exact(engine)


def test_an_engine_dead_before_any_request_says_so(subject):
    memory = RIG.memory(subject)
    tier = FaultyTier(memory, budget=1 << 30)
    tier.check_error = DeviceLost("gone at start")
    engine = engine_of(subject, tier=tier, memory=memory)
    engine.start()
    try:
        assert engine.wait_failed(timeout=60) == "the device is lost: DeviceLost: gone at start"
        with pytest.raises(EngineDead, match="gone at start"):
            engine.submit(Collect("late", prompt(8, 24), GREEDY).request)
    finally:
        engine.close()


def test_die_from_another_thread_stops_an_idle_engine_with_its_reason(subject):
    engine = engine_of(subject)
    engine.start()
    try:
        before = Collect("before", prompt(8, 25), GREEDY)
        engine.submit(before.request)
        assert before.end() == DoneEvent("length", 8, 8, 0)
        engine.die(RankLost("rank 1 of 2 (pid 7) exited: killed by SIGKILL"))   # what follow/spawn.py's watch does
        reason = "a tensor-parallel rank is lost: rank 1 of 2 (pid 7) exited: killed by SIGKILL"
        assert engine.wait_failed(timeout=60) == engine.failure == reason
        with pytest.raises(EngineDead, match="a tensor-parallel rank is lost"):
            engine.submit(Collect("later", prompt(8, 26), GREEDY).request)
    finally:
        engine.close()
    assert engine.snapshot()["failure"] == reason
