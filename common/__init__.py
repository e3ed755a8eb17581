"""What the frontend and the workers share: the model spec, the encodings, status codes and the
worker's configuration. Nothing here imports torch, so the frontend stays light."""
