"""A RULER-style long-context suite, generated offline: seeded, no download (#18).

Tasks follow RULER (Hsieh et al., 2024, https://arxiv.org/abs/2404.06654); the text is
ours. Every needle task hides "special magic" values for word keys in a haystack of noise
sentences and asks for them with RULER's answer prefix, so a base or instruct model can
complete the answer directly:

- ``single_number`` / ``single_word``: one key, its 7-digit number or its word;
- ``multikey``: four keys, one asked (the other three are distractors);
- ``multivalue``: one key with four numbers, all asked;
- ``multiquery``: four keys, two asked at once;
- ``variable_tracking``: a chain of five assignments ``VAR B = VAR A`` from one value,
  beside a distractor chain; asked for every variable holding the value;
- ``common_words``: a list of words in which three occur far more often than the rest;
  asked for those three.

A sample is scored by exact match in RULER's ``string_match_all`` form: correct when every
expected answer appears in the output as a whole word; no partial credit.
"""

from __future__ import annotations

import random
from itertools import pairwise

from evaluation import FILLER, Sample

from bmrt_kv.errors import BMRTError, check_int

TASKS = (
    "single_number",
    "single_word",
    "multikey",
    "multivalue",
    "multiquery",
    "variable_tracking",
    "common_words",
)

INTRO = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the {kind} afterwards.\n"
)
# Keys, word values and list words: plain, single-token-ish English words, distinct sets.
KEYS = [
    "apple",
    "anchor",
    "barrel",
    "beacon",
    "bishop",
    "canyon",
    "cedar",
    "cobalt",
    "copper",
    "dagger",
    "ember",
    "falcon",
    "fossil",
    "garnet",
    "glacier",
    "harbor",
    "hazel",
    "island",
    "jasper",
    "kettle",
    "lantern",
    "marble",
    "meadow",
    "nectar",
    "orchid",
    "pepper",
    "quartz",
    "raven",
    "saddle",
    "silver",
    "spruce",
    "summit",
    "thistle",
    "timber",
    "velvet",
    "walnut",
    "willow",
    "zephyr",
]
WORDS = [
    "bridge",
    "candle",
    "desert",
    "engine",
    "forest",
    "garden",
    "helmet",
    "jacket",
    "ladder",
    "magnet",
    "needle",
    "ocean",
    "pillow",
    "rocket",
    "shadow",
    "tunnel",
    "violin",
    "wagon",
    "yellow",
    "zipper",
    "basket",
    "button",
    "carpet",
    "dragon",
    "feather",
    "guitar",
    "hammer",
    "insect",
    "jungle",
    "kitten",
    "lemon",
    "mirror",
]
LIST_WORDS = [
    "able",
    "acid",
    "aged",
    "also",
    "area",
    "army",
    "away",
    "baby",
    "back",
    "ball",
    "band",
    "bank",
    "base",
    "bath",
    "bear",
    "beat",
    "bell",
    "belt",
    "best",
    "bird",
    "blow",
    "blue",
    "boat",
    "body",
    "bone",
    "book",
    "boot",
    "born",
    "boss",
    "both",
    "bowl",
    "bulk",
    "burn",
    "bush",
    "busy",
    "cake",
    "call",
    "calm",
    "came",
    "camp",
    "card",
    "care",
    "cart",
    "case",
    "cash",
    "cast",
    "cell",
    "chat",
    "chip",
    "city",
    "club",
    "coal",
    "coat",
    "code",
    "cold",
    "cook",
    "cool",
    "cope",
    "copy",
    "core",
    "cost",
    "crew",
    "crop",
    "dark",
    "data",
    "date",
    "dawn",
    "deal",
    "dear",
    "debt",
    "deck",
    "deep",
    "deer",
    "desk",
    "dial",
    "diet",
    "dirt",
    "dish",
    "dock",
    "door",
    "dose",
    "down",
    "draw",
    "drop",
    "drum",
    "dual",
    "duck",
    "dust",
    "duty",
    "each",
    "earn",
    "ease",
    "east",
    "easy",
    "edge",
    "else",
    "even",
    "ever",
    "exit",
    "face",
    "fact",
    "fair",
    "fall",
    "farm",
    "fast",
    "fate",
    "fear",
    "feed",
    "feel",
    "file",
    "fill",
    "film",
    "find",
    "fine",
    "fire",
    "firm",
    "fish",
    "five",
    "flag",
    "flat",
    "flow",
    "folk",
    "food",
    "foot",
    "form",
    "fort",
    "four",
    "free",
    "from",
    "fuel",
    "full",
    "fund",
    "gain",
    "game",
    "gate",
    "gear",
]


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _haystack(tokenizer, n_tokens: int, needles: list[str], rng: random.Random) -> str:
    """Noise sentences of about ``n_tokens`` tokens in all, with ``needles`` at random,
    distinct sentence boundaries in the order given."""
    per_filler = _n_tokens(tokenizer, FILLER)
    room = n_tokens - sum(_n_tokens(tokenizer, n) for n in needles)
    n_filler = max(len(needles) + 1, room // per_filler)
    slots = sorted(rng.sample(range(n_filler + 1), len(needles)))
    parts, last = [], 0
    for slot, needle in zip(slots, needles, strict=True):
        parts.append(FILLER * (slot - last))
        parts.append(needle + " ")
        last = slot
    parts.append(FILLER * (n_filler - last))
    return "".join(parts)


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _needle(key: str, value: str, kind: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _ask(key: str, kind: str) -> str:
    return (
        f"What is the special magic {kind} for {key} mentioned in the provided text? "
        f"The special magic {kind} for {key} mentioned in the provided text is"
    )


def make_sample(task: str, tokenizer, n_tokens: int, rng: random.Random) -> Sample:
    """One sample of ``task`` (one of :data:`TASKS`) with a context of about ``n_tokens``."""
    if task not in TASKS:
        raise BMRTError(f"unknown task {task!r}; the suite's tasks are {list(TASKS)}")
    check_int("n_tokens", n_tokens, 64, 2**31 - 1)
    keys = rng.sample(KEYS, 4)
    if task in ("single_number", "single_word"):
        kind = "number" if task == "single_number" else "word"
        value = _number(rng) if kind == "number" else rng.choice(WORDS)
        context = _haystack(tokenizer, n_tokens, [_needle(keys[0], value, kind)], rng)
        return _sample(task, kind, context, _ask(keys[0], kind), (value,), 12)
    if task == "multikey":
        values = [_number(rng) for _ in keys]
        needles = [_needle(k, v, "number") for k, v in zip(keys, values, strict=True)]
        rng.shuffle(needles)
        asked = rng.randrange(len(keys))
        context = _haystack(tokenizer, n_tokens, needles, rng)
        return _sample(task, "numbers", context, _ask(keys[asked], "number"), (values[asked],), 12)
    if task == "multivalue":
        values = [_number(rng) for _ in range(4)]
        needles = [_needle(keys[0], v, "number") for v in values]
        context = _haystack(tokenizer, n_tokens, needles, rng)
        question = (
            f"What are all the special magic numbers for {keys[0]} mentioned in the provided "
            f"text? The special magic numbers for {keys[0]} mentioned in the provided text are"
        )
        return _sample(task, "numbers", context, question, tuple(values), 48)
    if task == "multiquery":
        values = [_number(rng) for _ in keys]
        needles = [_needle(k, v, "number") for k, v in zip(keys, values, strict=True)]
        rng.shuffle(needles)
        a, b = sorted(rng.sample(range(len(keys)), 2))
        context = _haystack(tokenizer, n_tokens, needles, rng)
        question = (
            f"What are the special magic numbers for {keys[a]} and {keys[b]} mentioned in the "
            f"provided text? The special magic numbers for {keys[a]} and {keys[b]} mentioned "
            "in the provided text are"
        )
        return _sample(task, "numbers", context, question, (values[a], values[b]), 32)
    if task == "variable_tracking":
        names = _variable_names(rng, 10)
        value, other = _number(rng), _number(rng)
        chain, distractor = names[:5], names[5:]
        needles = []
        for chain_names, start in ((chain, value), (distractor, other)):
            needles.append(f"VAR {chain_names[0]} = {start}.")
            needles += [f"VAR {b} = VAR {a}." for a, b in pairwise(chain_names)]
        # Interleave the two chains, each in its own order, so every assignment follows
        # the one it copies.
        order = [0] * 5 + [1] * 5
        rng.shuffle(order)
        pos = [0, 5]
        ordered = []
        for which in order:
            ordered.append(needles[pos[which]])
            pos[which] += 1
        context = _haystack(tokenizer, n_tokens, ordered, rng)
        question = (
            f"Find all variables that are assigned the value {value} in the text above. "
            f"Answer: According to the chain(s) of variable assignment in the text above, 5 "
            f"variables are assigned the value {value}, they are:"
        )
        return _sample(task, "variables", context, question, tuple(chain), 32)
    # common_words
    words = rng.sample(LIST_WORDS, len(LIST_WORDS))
    common, rare = words[:3], words[3:]
    question = (
        "\nWhat are the 3 most common words in the above list? Answer: The top 3 words "
        "appearing most often in the list are:"
    )
    head = "Below is a numbered list of words.\n"
    total = max(60, n_tokens // 5)
    for _ in range(2):  # size the list from a first guess's measured tokens per line
        n_common = max(8, total // 12)
        listing = [w for w in common for _ in range(n_common)]
        # Each rare word occurs at most ceil(rest / len(rare)) times: far below n_common.
        listing += [rare[i % len(rare)] for i in range(max(0, total - len(listing)))]
        context = head + "\n".join(f"{i + 1}. {w}" for i, w in enumerate(listing))
        used = _n_tokens(tokenizer, context + question)
        total = max(60, round(total * n_tokens / used))
    order = rng.sample(listing, len(listing))
    context = head + "\n".join(f"{i + 1}. {w}" for i, w in enumerate(order))
    return Sample(context + "\n", question, common[0], tuple(common), task, 24)


def _sample(task, kind, context, question, answers, max_new_tokens) -> Sample:
    intro = INTRO.format(kind=kind if kind.endswith("s") else kind + "s")
    return Sample(intro + context + "\n", question, answers[0], answers, task, max_new_tokens)


def _variable_names(rng: random.Random, count: int) -> list[str]:
    names: set[str] = set()
    while len(names) < count:
        names.add("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)))
    return sorted(names, key=lambda _: rng.random())


def suite_samples(
    tokenizer, n_tokens: int, count: int, seed: int = 0, tasks=TASKS
) -> dict[str, list[Sample]]:
    """``count`` samples of each task in ``tasks`` at about ``n_tokens`` tokens, the same
    for the same seed (each task and length draws from its own generator)."""
    check_int("count", count, 1, 100_000)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise BMRTError(f"unknown tasks {unknown}; the suite's tasks are {list(TASKS)}")
    out = {}
    for task in tasks:
        rng = random.Random(f"{seed}:{task}:{n_tokens}")
        out[task] = [make_sample(task, tokenizer, n_tokens, rng) for _ in range(count)]
    return out
