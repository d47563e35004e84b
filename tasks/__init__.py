"""Task layer: resource model, pilots, scheduler, launchers, backends, worker."""
