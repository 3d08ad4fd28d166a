"""Demo rows, one module per package.

Each module defines ``ROWS``: an ordered mapping from a row id to a function that
takes no argument and returns a :class:`membound_integration.row.Row`. The demo runs
every row in a fresh process so that each row's peak RSS is its own.
"""

ORDER = [
    "plain",
    "zstd_linear",
    "bmrt_kv",
    "paired_cache",
    "combined",
    "moe_expert_cache",
    "diffulex_edge",
]
