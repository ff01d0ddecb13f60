"""Training runs: CIFAR-100 under torchrun with our DDP or torch's (ddp_cifar100), and
a job that shrinks its group after a rank dies (shrink_training)."""
