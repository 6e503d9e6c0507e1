"""Actors: one actor class per file (rollout, verifier, learner, drafter); where they run lives in deploy/."""
