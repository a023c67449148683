import sys

from dtjob.launcher.agent import main

sys.exit(main())
