"""A task where the instructions decide the reward: reply with a word in the format they ask for."""
