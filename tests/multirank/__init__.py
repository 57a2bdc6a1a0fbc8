"""The multirank suite: gloo ranks, launchers, builds and scripts in processes of their own."""
