"""Three held-out texts of different kinds for router traces and perplexity (written for
membound, or this package's own MIT source; no dataset download). None of them is in
:mod:`membound_testing.moefy.calibration`."""

from __future__ import annotations

from pathlib import Path

PROSE = (
    "The lighthouse stands on a rock a mile from the shore, and for a hundred and forty "
    "years a keeper lived in it. The first keepers lit oil lamps at dusk and trimmed the "
    "wicks every four hours through the night; a clockwork weight, wound by hand, turned "
    "the great glass lens so that the beam swept the sea once every twenty seconds. Ships "
    "knew the coast by that rhythm. A captain who counted a flash every twenty seconds "
    "knew that he was off the point and that the reef lay to the south, while a flash "
    "every fifteen seconds meant the harbour light farther along the bay. The keeper's "
    "log records the weather at every watch, the ships that passed, the supply boat that "
    "came on the first Monday of each month when the sea allowed it, and the long weeks "
    "in winter when it did not. In one February the boat could not land for seven weeks, "
    "and the keeper and his wife lived on salted fish, potatoes and the eggs of the hens "
    "they kept in a shed against the tower wall. Their children learned to read from the "
    "log itself, copying the entries in a careful hand. Electricity reached the rock in "
    "the year after the war, carried by a cable laid along the sea floor, and the lamp "
    "no longer needed a flame. A motor turned the lens, and a bell rang in the keeper's "
    "room if it stopped. The keepers stayed for another thirty years, because the "
    "authorities did not yet trust a machine to run alone through a storm. When the "
    "light was finally automated, the last keeper locked the door, handed the key to the "
    "engineer, and rowed to the mainland. The tower is now a museum in summer. Visitors "
    "climb the spiral stair of a hundred and twelve steps, stand in the lantern room and "
    "look out over the reef, and read the old log in a glass case by the door. Many of "
    "them are surprised to learn that the light still works. Every night it sweeps the "
    "sea once every twenty seconds, as it always has, although the ships that pass now "
    "carry satellite receivers and rarely look for it. The fishermen still do. They say "
    "that a screen can fail, but the light on the rock has not missed a night in living "
    "memory, and on a dark evening, coming home against the wind, there is nothing more "
    "welcome than that steady white flash rising out of the rain."
)

CHAT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is the difference between a list and a tuple in Python?"
    "<|im_end|>\n<|im_start|>assistant\nBoth hold an ordered sequence of values, but a "
    "list can be changed after it is made and a tuple cannot. You can append to a list, "
    "remove items from it or replace one of its elements; a tuple keeps the values it was "
    "created with. Because a tuple never changes, Python can use it as a dictionary key "
    "or put it in a set, which a list cannot be. Use a list for a collection that grows "
    "or shrinks, such as the lines read from a file, and a tuple for a fixed group of "
    "related values, such as the x and y coordinates of a point.<|im_end|>\n"
    "<|im_start|>user\nHow do I read a text file line by line?<|im_end|>\n"
    "<|im_start|>assistant\nOpen the file in a with statement and loop over it:\n\n"
    "with open('notes.txt', encoding='utf-8') as f:\n    for line in f:\n"
    "        print(line.rstrip())\n\nThe with statement closes the file when the block "
    "ends, even if an error happens inside it. Looping over the file object reads one "
    "line at a time, so even a very large file does not have to fit in memory. Each line "
    "keeps its newline character at the end, which is why the example strips it before "
    "printing.<|im_end|>\n<|im_start|>user\nCan you suggest a simple dinner I can cook in "
    "twenty minutes?<|im_end|>\n<|im_start|>assistant\nA vegetable stir fry with rice is "
    "quick and flexible. Put the rice on first: rinse one cup, add two cups of water and "
    "a pinch of salt, bring it to the boil, then cover and simmer for fifteen minutes. "
    "While it cooks, slice an onion, a pepper, a carrot and a handful of mushrooms. Heat "
    "a spoonful of oil in a large pan until it shimmers, add the onion and carrot first "
    "because they take longest, and stir for three minutes. Add the pepper and mushrooms "
    "for another three. Finish with a crushed clove of garlic, a spoonful of soy sauce "
    "and a squeeze of lemon juice. Serve it over the rice, with a fried egg on top if you "
    "want more protein.<|im_end|>\n<|im_start|>user\nWhy is the sky blue?<|im_end|>\n"
    "<|im_start|>assistant\nSunlight contains every colour. As it passes through the "
    "air, it meets molecules of nitrogen and oxygen that are much smaller than the "
    "wavelength of light, and they scatter short wavelengths far more strongly than long "
    "ones. Blue light is scattered about five times more than red, so it reaches your "
    "eyes from every part of the sky, while most of the red and yellow light travels "
    "straight on. At sunset the light crosses much more air before it reaches you, the "
    "blue is scattered away along the path, and the sky near the sun turns orange and "
    "red.<|im_end|>\n<|im_start|>user\nThank you! One last question: how many minutes "
    "are there in a week?<|im_end|>\n<|im_start|>assistant\nA week has seven days, each "
    "day has twenty-four hours and each hour sixty minutes, so a week has 7 x 24 x 60 = "
    "10,080 minutes.<|im_end|>\n"
)

# This package's own source, held out of the calibration text.
CODE_MODULES = ("simulator.py", "trace.py")


def code_text() -> str:
    src = Path(__file__).resolve().parents[1] / "src" / "moe_expert_cache"
    return "\n\n".join((src / m).read_text() for m in CODE_MODULES)


def texts() -> dict[str, str]:
    """kind -> text: prose, chat, code."""
    return {"prose": PROSE, "chat": CHAT, "code": code_text()}
