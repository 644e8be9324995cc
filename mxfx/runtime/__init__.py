"""Runtime state under the compiled graphs: weight caches, the crossover table, FSDP2 operand forms."""
