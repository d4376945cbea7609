"""The runner (the paper's client): pulls tasks from the bridge and runs the user's agent."""
