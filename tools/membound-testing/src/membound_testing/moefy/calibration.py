"""Calibration text for :func:`membound_testing.moefy.moefy_cached`: English prose (the two
passages membound wrote for paired-cache's quality benchmark) and a sample of Python source,
so that the experts are clustered on both kinds of text. moe-expert-cache's benchmarks'
held-out texts share nothing with it.

The code sample is ``calibration_code.txt``: moe-expert-cache 0.9.0's ``policies.py`` and
``slots.py``, kept here as data. Through moe-expert-cache 0.9.0 the text was read from the
installed package, so an edit to either module built the MoE anew; the copy keeps the
calibration tokens, and so the build, fixed.
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
        The prose, a blank line, then the code sample.
    """
    code = (Path(__file__).parent / "calibration_code.txt").read_text(encoding="utf-8")
    return PROSE + "\n\n" + code
