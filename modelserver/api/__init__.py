"""HTTP handlers per task: OpenAI request and response shaping, shared by real and fake engines."""
