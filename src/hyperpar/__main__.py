from hyperpar.cli import main

raise SystemExit(main())
