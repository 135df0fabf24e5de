"""One router per endpoint group, as in Triton's openai_frontend: chat, completions, models, observability."""
