"""Environments for multi-turn episodes (DESIGN §4): the interface (base), loading one by name or URL (loading,
http), the episode driver (episodes, with transcript and calls), and the built-in environments of the tiny task
(calculator, guess_number). The RL recipe includes `config.EnvSection` as its `env` section."""
