"""Calibration text for :func:`membound_testing.moefy.moefy_cached`: English prose (the two
passages membound wrote for paired-cache's quality benchmark), a sample of Python source,
and (since build format 4) a chat transcript written for membound with more Python source,
so that the experts are clustered, and the routers fitted, on the three kinds of text the
held-out benchmarks read. moe-expert-cache's benchmarks' held-out texts share nothing with it.

The code sample is ``calibration_code.txt``: moe-expert-cache 0.9.0's ``policies.py`` and
``slots.py``, kept here as data. Through moe-expert-cache 0.9.0 the text was read from the
installed package, so an edit to either module built the MoE anew; the copy keeps the
calibration tokens, and so the build, fixed. ``calibration_more.txt`` (about 2,700 SmolLM2
tokens) is the chat transcript and source that diffulex-edge 0.11.0 ships in its own
calibration text, copied the same way. With it a layout of a shared expert of 1,024 and
top-64 of 128 experts scored 1.25 / 1.23 / 1.09x dense perplexity on the prose / chat /
code texts, against 1.26 / 1.30 / 1.13x with the 2,985 tokens of prose and code alone
(``/tmp`` script with ``moefy_sweep``'s masking, 2026-12-06).
"""

from __future__ import annotations

from pathlib import Path

PROSE = (
    "The river rises in the hills to the north and runs for two hundred miles before it "
    "reaches the sea. For most of its course it is slow and wide, and in summer children "
    "swim in the shallow bends while their parents fish from the banks. The old mill at "
    "the first bridge still turns, though it has ground no flour for fifty years; a "
    "museum now keeps its stones and its ledgers, which record every sack that came "
    "through the door. Farther down, the valley opens into farmland. Wheat and barley "
    "grow on the higher fields, and the lower meadows flood each spring, leaving a layer "
    "of silt that makes the soil rich. The town at the mouth of the river grew up around "
    "its harbour. Ships once carried wool and timber from its quays to ports across the "
    "channel, and the merchants who grew wealthy from that trade built the tall stone "
    "houses that line the market square. Today the harbour holds fishing boats and small "
    "yachts, and the warehouses have become shops, cafes and flats. Visitors come in the "
    "summer to walk the coastal path, to eat fish that was landed the same morning, and "
    "to watch the tide race through the narrow entrance of the bay. In winter the town is"
    " quiet. Storms drive the boats into shelter, and the streets belong to the people "
    "who live there all year round. The school teaches the history of the river to every "
    "child, and most of them can name the villages along its banks in order, from the "
    "spring to the sea."
    "\n\n"
    "A computer stores numbers in binary, as strings of ones and zeros. Each digit is "
    "called a bit, and eight bits make a byte. A program is a list of instructions that "
    "the processor follows one after another: it loads numbers from memory, adds or "
    "compares them, and writes the results back. Because the processor is much faster "
    "than the main memory, modern machines keep small, fast caches close to the "
    "processor. When a program reads the same data again soon, or reads data stored next "
    "to what it read before, the cache can answer quickly and the processor does not have"
    " to wait. Programmers who care about speed therefore arrange their data so that it "
    "is read in order, and they avoid jumping around in large tables. The same idea "
    "applies to disks and networks: moving data is often more expensive than computing "
    "with it. Large language models are a striking example. To produce each word, such a "
    "model reads all of its weights from memory, yet it performs only a few arithmetic "
    "operations on each number it reads. On a laptop or a phone, the time to generate "
    "text is set mostly by how fast memory can be read, not by how fast the processor can"
    " multiply. This is why researchers look for ways to skip the parts of the model that"
    " matter least for the current word, so that less memory has to be read while the "
    "answer stays the same."
)


def calibration_text() -> str:
    """The calibration text.

    Returns:
        The prose, the code sample, then the chat transcript and its source, a blank line
        between each.
    """
    here = Path(__file__).parent
    code, more = (
        (here / name).read_text(encoding="utf-8")
        for name in ("calibration_code.txt", "calibration_more.txt")
    )
    return PROSE + "\n\n" + code + "\n\n" + more
