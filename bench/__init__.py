"""promptlb's benchmark suite: scenarios, the live cluster runner, the simulator, capacity
planning. ``promptlb-bench --help`` lists the commands."""
