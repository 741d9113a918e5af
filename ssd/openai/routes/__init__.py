"""The OpenAI API's routers, one per API, each with its store (ssd.openai.app puts them together)."""
