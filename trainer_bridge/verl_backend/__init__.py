"""The verl backend: spanrl's training samples trained by verl's own workers, served by vLLM."""
