"""The budget runner's machinery: a command in its own cgroup under a hard memory limit and a
storage read throttle (runner, cgroup), bisection of the smallest limit at which it still
passes, and the device profiles. Package benchmarks and the integration package's
`hatch run budget` both use it; it imports no package of the repo (standard library only)."""
