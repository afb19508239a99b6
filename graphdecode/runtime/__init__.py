"""Sequences, pages, scheduler, runner, pythonizer, detokenizer and the LLM front end."""
