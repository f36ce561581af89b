"""Several processes computing one model: tensor parallelism's group and collectives."""
