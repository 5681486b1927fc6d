"""How autogaudi gets into a process: the launcher, the environment's bootstrap, child processes."""
