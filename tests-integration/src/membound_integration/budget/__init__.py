"""`hatch run budget`: every demo row under the device profiles, the smallest hard limit at
which each still answers right (suite), and the budget curve (curve). The machinery (cgroups,
the runner, bisection, the profiles) is membound_testing.budget."""
