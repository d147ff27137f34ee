"""IAM: the Authorizer boundary and its implementations (embedded Cedar; remote AuthZEN later)."""
