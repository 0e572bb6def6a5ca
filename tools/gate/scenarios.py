"""The gate's multi-turn scenarios. Each conversation opens with text of its own, so no scenario resumes from
another's states; message sizes are in words (`scale` multiplies them) so that histories reach 1-2k tokens."""

from __future__ import annotations

import random
from collections.abc import Callable

from gate.runs import Messages, Recorder

WORDS = ("state kept resume turn model layer token page cache prefix history answer question reason light river "
         "mountain city garden window market winter summer music paper story letter engine signal number table "
         "system memory stream chunk window device host budget evict order recent older newer quiet rapid bright "
         "simple careful gentle steady broad narrow open closed early late north south east west").split()
SYSTEM_WORDS = 120
USER_WORDS = 60
FILLER_WORDS = 300
MAX_FILLERS = 64


def text(tag: str, words: int, scale: float) -> str:
    """`words` × `scale` seeded words after `tag`: the same tag always gives the same text."""
    rng = random.Random(tag)
    return tag + ": " + " ".join(rng.choice(WORDS) for _ in range(max(1, round(words * scale)))) + "."


def system(tag: str, scale: float) -> dict[str, str]:
    """A system message of its own."""
    return {"role": "system", "content": text(f"You are assistant {tag}", SYSTEM_WORDS, scale)}


def user(tag: str, scale: float, words: int = USER_WORDS) -> dict[str, str]:
    """A user message of its own."""
    return {"role": "user", "content": text(f"Question {tag}", words, scale)}


def chat(rec: Recorder, messages: Messages, tag: str, scale: float) -> Messages:
    """Ask a new user message, answer it, and return the longer conversation."""
    asked = [*messages, user(tag, scale)]
    reply = rec.turn(asked).reply
    return [*asked, {"role": "assistant", "content": reply.text}]


def nine_turns(rec: Recorder, scale: float) -> None:
    """A 9-turn chat: every turn from the second on resumes where the previous turn's history ends."""
    messages = [system("nine-turns", scale)]
    for turn in range(9):
        messages = chat(rec, messages, f"nine-turns {turn}", scale)


def alternating(rec: Recorder, scale: float) -> None:
    """Two conversations on one system prompt, turns alternating: B's first turn resumes at the system-prompt
    end A kept, every later turn at its own history end."""
    shared = system("alternating (shared)", scale)
    a, b = [shared], [shared]
    for turn in range(3):
        a = chat(rec, a, f"alternating A {turn}", scale)
        b = chat(rec, b, f"alternating B {turn}", scale)


def edited_first(rec: Recorder, scale: float) -> None:
    """Three turns, then the first user message edited: the edit resumes at the system-prompt end, and the
    edited branch's next turn at its own history end."""
    messages = [system("edited-first", scale)]
    for turn in range(3):
        messages = chat(rec, messages, f"edited-first {turn}", scale)
    edited = chat(rec, [messages[0]], "edited-first 0 (edited)", scale)
    chat(rec, edited, "edited-first 1 (after the edit)", scale)


def regenerate(rec: Recorder, scale: float) -> None:
    """Three turns, the last regenerated (same request: resumes at its history end, same tokens), then the last
    user message edited (resumes at the rewind cut before it) and the edited branch continued."""
    messages = [system("regenerate", scale)]
    for turn in range(2):
        messages = chat(rec, messages, f"regenerate {turn}", scale)
    last = [*messages, user("regenerate 2", scale)]
    rec.turn(last)
    rec.turn(last, same_as=len(rec.run.exchanges) - 1)
    edited = [*messages, user("regenerate 2 (edited)", scale)]
    reply = rec.turn(edited).reply
    chat(rec, [*edited, {"role": "assistant", "content": reply.text}], "regenerate 3 (after the edit)", scale)


def two_at_once(rec: Recorder, scale: float) -> None:
    """Two chats of their own, each turn of both sent at once: each resumes from its own states only."""
    chats: list[Messages] = [[system("two-at-once X", scale)], [system("two-at-once Y", scale)]]
    for turn in range(3):
        asked = [[*c, user(f"two-at-once {name} {turn}", scale)] for c, name in zip(chats, "XY", strict=True)]
        replies = rec.together(asked)
        chats = [[*a, {"role": "assistant", "content": r.reply.text}] for a, r in zip(asked, replies, strict=True)]


def fill_until(rec: Recorder, done: Callable[[], bool], scale: float, tag: str) -> int:
    """Send one-message conversations of their own until `done()`: each keeps one state (its history end), a
    state nothing moves past, so they push older states down in the order those were used."""
    for n in range(MAX_FILLERS):
        if done():
            return n
        rec.turn([user(f"filler {tag} {n}", scale, FILLER_WORDS)], max_tokens=2)
    raise SystemExit(f"the eviction scenario sent {MAX_FILLERS} fillers and the tiers still hold its states: give "
                     f"the cache-on server smaller --prompt-cache-gib (and --host-cache-gib) budgets")


def pushed_out(rec: Recorder, tier: str) -> Callable[[], bool]:
    """True once `tier` has evicted as many states as it held now: then every state it held now has left it
    (it evicts superseded, then least recently used states first, and newer states came after these)."""
    held = rec.tiers()[tier]
    target = held["evicted"] + held["states"]
    return lambda: rec.tiers()[tier]["evicted"] >= target


def eviction(rec: Recorder, scale: float) -> None:
    """Eviction pressure, device → host → evicted: A's states are pushed off the device (to the host when there
    is one) and A's next turn resumes from the host; then B's states are pushed out of every tier and B's next
    turn prefills from the start."""
    tiers = rec.tiers()
    if "device" not in tiers:
        raise SystemExit("the eviction scenario needs a cache-on server (--prompt-cache-gib above 0)")
    host = tiers.get("host", {}).get("budget", 0) > 0
    a = chat(rec, [system("eviction A", scale)], "eviction A 0", scale)
    fill_until(rec, pushed_out(rec, "device"), scale, "A")
    if not host:
        rec.model.drop_all()
    rec.turn([*a, user("eviction A 1", scale)], expected_tier="host" if host else "none")
    b = chat(rec, [system("eviction B", scale)], "eviction B 0", scale)
    fill_until(rec, pushed_out(rec, "device"), scale, "B")
    if host:
        fill_until(rec, pushed_out(rec, "host"), scale, "B (host)")
    rec.model.drop_all()
    rec.turn([*b, user("eviction B 1", scale)], expected_tier="none")


SCENARIOS: dict[str, Callable[[Recorder, float], None]] = {
    "nine-turns": nine_turns,
    "alternating": alternating,
    "edited-first": edited_first,
    "regenerate": regenerate,
    "two-at-once": two_at_once,
    "eviction": eviction,
}
DROPS = {"eviction"}
