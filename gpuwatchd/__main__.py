from gpuwatchd.cli import main

raise SystemExit(main())
