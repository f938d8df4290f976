// Loads the coordinator's API and the google.rpc error details at run time with
// @grpc/proto-loader. The TypeScript types under ./generated come from the same .proto files
// through `npm run generate` (proto-loader-gen-types); the loader options below must stay the
// ones that script passes, or the types would describe different objects.
import * as path from 'node:path';
import * as grpc from '@grpc/grpc-js';
import * as protoLoader from '@grpc/proto-loader';

import type { ProtoGrpcType as ApiTypes } from './generated/idempotency';
import type { ProtoGrpcType as StatusTypes } from './generated/status';
import type { ProtoGrpcType as ErrorDetailsTypes } from './generated/error_details';

/** The build copies the repository's proto/ folder here (dist/proto), so the package carries it. */
const API_PROTO_ROOT = path.join(__dirname, '..', 'proto');
/** google-proto-files ships google/rpc/*.proto; its package folder is the include root. */
const GOOGLE_PROTO_ROOT = path.dirname(require.resolve('google-proto-files/package.json'));

export const LOADER_OPTIONS: protoLoader.Options = {
  // uint64 lease tokens would lose precision as JS numbers; strings are converted to bigint.
  longs: String,
  // A virtual `outcome`/`state` field names the member of each oneof, and `_checkpoint` tells
  // an absent optional checkpoint from an empty one.
  oneofs: true,
  arrays: true,
  includeDirs: [API_PROTO_ROOT, GOOGLE_PROTO_ROOT],
};

const packageDefinition = protoLoader.loadSync(
  ['idempotency/v1/idempotency.proto', 'google/rpc/status.proto', 'google/rpc/error_details.proto'],
  LOADER_OPTIONS,
);

export const proto = grpc.loadPackageDefinition(packageDefinition) as unknown as ApiTypes &
  StatusTypes &
  ErrorDetailsTypes;

export type {
  IdempotencyServiceClient,
} from './generated/idempotency/v1/IdempotencyService';
