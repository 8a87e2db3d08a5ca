"""The `refit demo`: a real trainer and a real engine process, verified after every refit."""
