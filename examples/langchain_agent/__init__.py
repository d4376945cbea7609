"""A LangChain agent for spanrl (an ordinary LangChain agent: no spanrl import)."""
