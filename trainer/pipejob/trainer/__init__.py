"""What runs inside each pod: reads the env contract, joins the RPC world, runs its role."""
